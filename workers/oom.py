"""Whether an exception raised inside a training process means "out of memory", in any of its forms.

Why a module of its own: on a GPU an OOM reaches the top of a script in many shapes, and each one
misread as a crash costs the search a bound (issue: GPU OOMs classed `crashed`). The forms seen:
- `torch.OutOfMemoryError` (alias `torch.cuda.OutOfMemoryError`) raised by the caching allocator;
- a plain `RuntimeError` carrying the allocator's text (TorchScript, older torch, libraries that
  re-raise), or cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED`;
- `torch.AcceleratorError` for `cudaErrorMemoryAllocation` ("CUDA error: out of memory");
- NCCL failing to allocate its buffers: a `DistBackendError` "Failed to CUDA calloc";
- any of these as the `__cause__` or `__context__` of what finally propagates: a script or library
  that catches the OOM and raises its own error, or calls `sys.exit(1)` inside the `except` block;
- a host `MemoryError`.
Everything is decided from the exception objects the process itself holds, never by reading stderr:
another rank's log line, or a script printing "out of memory" as advice, must not turn into an OOM.
"""
from __future__ import annotations

import sys

#: cudaErrorMemoryAllocation: the `error_code` torch.AcceleratorError carries for a failed cudaMalloc.
CUDA_ERROR_MEMORY_ALLOCATION = 2
#: Texts that only the allocators themselves put into an exception's message.
_ALLOCATOR_TEXTS = ("CUDA out of memory", "CUDA error: out of memory", "HIP out of memory",
                    "XPU out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                    "Failed to CUDA calloc", "cudaErrorMemoryAllocation")
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
