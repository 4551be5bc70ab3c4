"""Whether an exception raised inside a training process means "out of memory", in any of its forms.

Why a module of its own: on a GPU an OOM reaches the top of a script in many shapes, and each one
misread as a crash costs the search a memory bound (the config is recorded `crashed`). The forms seen:
- `torch.OutOfMemoryError` (alias `torch.cuda.OutOfMemoryError`) raised by the caching allocator;
- a plain `RuntimeError` carrying the allocator's text (TorchScript, older torch, libraries that
  re-raise), or cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED`;
- `torch.AcceleratorError` for `cudaErrorMemoryAllocation` ("CUDA error: out of memory");
- NCCL failing to allocate its buffers: a `DistBackendError` whose "Last error" is NCCL's own warning,
  "Failed to CUDA calloc", "Cuda failure 'out of memory'" (or "Cuda failure 2 'out of memory'"), or
  on newer NCCL a failed call inside `ncclCudaCalloc...`;
- any of these as the `__cause__` or `__context__` of what finally propagates: a script or library
  that catches the OOM and raises its own error, or calls `sys.exit(1)` inside the `except` block;
- a host `MemoryError`.
Decided from the exception objects the process itself holds wherever `workers.in_rank.entry` runs the script
in the rank's own interpreter. A script started through a wrapper (a shell script, `--no_python`, its
own launcher) shows its OOM only as a traceback on the rank's stderr; and an OOM that NCCL meets
inside a collective is often caught by torch's NCCL watchdog thread, which ends the process with
SIGABRT (`TORCH_NCCL_ASYNC_ERROR_HANDLING`'s default) after printing the C++ exception, with no
Python traceback and no exit report. `stderr_out_of_memory` reads both from the rank's stderr,
strictly: only the last fatal report counts (the final exception line of the last Python traceback,
or the `what():` text of the last C++ "terminate called after throwing" from torch's c10), so another
rank's log line, a warning, or a script printing "out of memory" as advice never turns into an OOM.
A process that aborted with nothing readable on stderr still left the allocator's counters in its
interim exit report (`workers.in_rank.device_memory.InterimReports`): `aborted_out_of_memory` reads them.
"""
from __future__ import annotations

import re
import signal
import sys
from collections.abc import Mapping
from typing import Any

#: cudaErrorMemoryAllocation: the `error_code` torch.AcceleratorError carries for a failed cudaMalloc.
CUDA_ERROR_MEMORY_ALLOCATION = 2
#: Texts that only the allocators themselves put into an exception's message.
_ALLOCATOR_TEXTS = ("CUDA out of memory", "CUDA error: out of memory", "HIP out of memory",
                    "XPU out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                    "Failed to CUDA calloc", "cudaErrorMemoryAllocation", "Cuda failure 'out of memory'",
                    "Cuda failure 2 'out of memory'", "ncclCudaCalloc")
#: Exception types whose message is the allocator's own (a user's ValueError saying "out of memory"
#: is not an allocation failure).
_RUNTIME_TYPES = (RuntimeError,)


def out_of_memory_cause(exc: BaseException | None) -> BaseException | None:
    """The exception in `exc`'s cause/context chain that is an out-of-memory, or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if is_out_of_memory(exc):
            return exc
        exc = exc.__cause__ if exc.__cause__ is not None else exc.__context__
    return None


def is_out_of_memory(exc: BaseException) -> bool:
    """One exception object, not its chain: see the module docstring for the forms recognised."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None:
        oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                      getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None))
                          if isinstance(t, type))
        if oom_types and isinstance(exc, oom_types):
            return True
        accelerator_error = getattr(torch, "AcceleratorError", None)
        if isinstance(accelerator_error, type) and isinstance(exc, accelerator_error):
            if getattr(exc, "error_code", None) == CUDA_ERROR_MEMORY_ALLOCATION:
                return True
    if isinstance(exc, _RUNTIME_TYPES):
        text = str(exc)
        return any(marker in text for marker in _ALLOCATOR_TEXTS)
    return False


#: The names an allocator's out-of-memory exception is printed under as a traceback's last line.
_OOM_TYPE_NAMES = ("torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError", "OutOfMemoryError", "MemoryError")
#: Types whose printed message must carry an allocator's own text (`_ALLOCATOR_TEXTS`) to count.
_RUNTIME_TYPE_NAMES = ("RuntimeError", "torch.AcceleratorError", "AcceleratorError",
                       "torch.distributed.DistBackendError", "DistBackendError")
#: What launchers put before each line of a rank's output: "[rank0]: ", "[default0]:".
_LINE_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_TRACEBACK = "Traceback (most recent call last):"
#: How libstdc++ reports an uncaught C++ exception before abort(); torch's own exceptions are c10's.
_TERMINATE = re.compile(r"^terminate called after throwing an instance of '(?P<type>c10::\w+)'")
#: Where the `what():` text of a c10 exception ends: its throw site, then the C++ stack frames.
_WHAT_ENDS = ("Exception raised from", "frame #")


def stderr_out_of_memory(text: str) -> str | None:
    """What `text` (a rank's stderr) shows as its out-of-memory, or None: the last fatal report in it,
    a Python traceback or a C++ abort (`_c10_abort_out_of_memory`), decides. A traceback counts when
    its exception line (the first unindented line after its frames) is an allocator's OOM; lines
    after it (a launcher's own "exits with return code" line) do not matter, a later traceback or
    abort does (a script that caught the OOM and raised its own error)."""
    lines = [_LINE_PREFIX.sub("", line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.strip() == _TRACEBACK]
    aborts = [i for i, line in enumerate(lines) if _TERMINATE.match(line.strip())]
    if aborts and (not starts or aborts[-1] > starts[-1]):
        return _c10_abort_out_of_memory(lines[aborts[-1]:])
    if not starts:
        return None
    for line in lines[starts[-1] + 1:]:
        if not line.strip() or line.startswith((" ", "\t")):
            continue
        name, _, message = line.partition(":")
        name = name.strip()
        if name in _OOM_TYPE_NAMES:
            return line.strip()
        if name in _RUNTIME_TYPE_NAMES and any(marker in message for marker in _ALLOCATOR_TEXTS):
            return line.strip()
        return None
    return None


def _c10_abort_out_of_memory(lines: list[str]) -> str | None:
    """The `what():` text of a c10 exception that aborted the process (`lines` start at libstdc++'s
    "terminate called after throwing" line) when it carries an allocator's or NCCL's out-of-memory
    text: torch's NCCL watchdog rethrows the collective's error this way, e.g. "Process group
    watchdog thread terminated with exception: NCCL error ... unhandled cuda error ... Last error:
    Cuda failure 'out of memory'"."""
    what: list[str] = []
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith(_WHAT_ENDS) or (what and not stripped):
            break
        if stripped:
            what.append(stripped.removeprefix("what():").strip())
    message = " ".join(what)
    if any(marker in message for marker in _ALLOCATOR_TEXTS):
        return f"{_TERMINATE.match(lines[0].strip())['type']}: {message}"
    return None


def aborted_out_of_memory(exit_code: int | None, report: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """For a process killed by SIGABRT that left only an interim exit report: (why it was an OOM,
    why it probably was one). The CUDA allocator's OOM count above zero makes it an OOM (an
    allocation failed; what followed aborted). Retries alone (the allocator freed its cache to
    serve an allocation: memory was tight) make it probable only: recorded, no memory bound."""
    if exit_code != -signal.SIGABRT or not report.get("interim"):
        return None, None
    ooms, retries = report.get("device_ooms", 0), report.get("device_alloc_retries", 0)
    if ooms:
        return f"the CUDA allocator counted {ooms} out-of-memory error(s) before the process aborted (SIGABRT)", None
    if retries:
        return None, (f"the CUDA allocator retried {retries} allocation(s) after freeing its cache before the "
                      "process aborted (SIGABRT): probably out of memory")
    return None, None
