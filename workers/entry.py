"""`python -m workers.entry script.py args...`: run a Python training script as `python script.py` would,
but turn an out-of-memory exception into a distinct exit status.

A CUDA OOM (or a host MemoryError) is an OOM, not a crash, and the search treats it as an upper
bound on the micro-batch size. Recognising it from the exception type, here in the same process,
is exact; searching stderr for the text would not be.
"""
from __future__ import annotations

import os
import runpy
import sys

from workers.failure import OOM_EXIT_CODE


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None) if torch else None
    return oom_type is not None and isinstance(exc, oom_type)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m workers.entry script.py [args...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except Exception as exc:
        if _is_out_of_memory(exc):
            print(f"workers.entry: out of memory: {type(exc).__name__}: {exc}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(OOM_EXIT_CODE)
        raise


if __name__ == "__main__":
    main()
