"""Whether a training process died because an op it needs could not be built or loaded.

Why: DeepSpeed compiles its ops (FusedAdam, CPUAdam, the CPU all-reduce, ...) on first use, inside
the experiment. On a node without a CUDA toolkit (`nvcc`), without a compiler, or with a toolkit
that does not match torch's CUDA, the build fails the same way in every experiment of the job: each
one is recorded `crashed`, retried, and the search spends its whole budget learning nothing.
Recognised here, the job stops at its first such experiment with one line that names
the op and the fix (`scheduler.search.fast_search`), and a resumed job launches that experiment again once
the node can build it.

Decided from the exception object the rank's own interpreter holds (`workers.in_rank.entry`), like an OOM
(`workers.in_rank.oom`): an exception in the cause/context chain that was raised inside an op builder,
i.e. whose traceback passes through DeepSpeed's `deepspeed/ops/op_builder/` or torch's
`torch/utils/cpp_extension.py` (JIT compilation and loading). The forms seen: torch's
`RuntimeError: Error building extension 'fused_adam'` (the compiler failed), torch's `OSError:
CUDA_HOME environment variable is not set` and DeepSpeed's `MissingCUDAException` (no toolkit),
DeepSpeed's `CUDAMismatchException` (toolkit and torch disagree), "found no CUDA devices", "ninja
not being installed". Whatever the text, the frames say where it was raised, so a script's own error
that merely mentions "extension" is not one. The op's name is the builder's (`OpBuilder.name`) or
the name torch was asked to build.
"""
from __future__ import annotations

import os
from types import TracebackType

#: The error's first line is cut here: the error line of a stopped job quotes it (the rest is in stderr.log).
FIRST_LINE_CHARS = 160
#: Path fragments of the code that builds and loads ops at run time.
_BUILDER_PATHS = ("deepspeed/ops/op_builder/", "torch/utils/cpp_extension.py")


def op_build_failure(exc: BaseException | None) -> str | None:
    """"<op>: <ExceptionType>: <first line>" for the op-build failure in `exc`'s cause/context chain,
    or None when no exception of the chain was raised while building or loading an op."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        op = _op_being_built(exc.__traceback__)
        if op is not None:
            first_line = next((line for line in str(exc).splitlines() if line.strip()), "").strip()
            if len(first_line) > FIRST_LINE_CHARS:  # torch's build error goes on with the compiler's command
                first_line = first_line[:FIRST_LINE_CHARS] + "..."
            return f"{op or 'an op'}: {type(exc).__name__}: {first_line}"
        exc = exc.__cause__ if exc.__cause__ is not None else exc.__context__
    return None


def _op_being_built(tb: TracebackType | None) -> str | None:
    """The op's name ("" when unknown) if the traceback passes through an op builder, else None.
    DeepSpeed's builder names the op; torch's `load(name=...)` names the extension."""
    found: str | None = None
    builder_name = extension_name = ""
    while tb is not None:
        frame = tb.tb_frame
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if any(fragment in path for fragment in _BUILDER_PATHS):
            found = ""
            owner = frame.f_locals.get("self")
            if not builder_name and "op_builder" in path and isinstance(getattr(owner, "name", None), str):
                builder_name = owner.name
            name = frame.f_locals.get("name")
            if not extension_name and path.endswith("cpp_extension.py") and isinstance(name, str):
                extension_name = name
        tb = tb.tb_next
    if found is None:
        return None
    return builder_name or extension_name
