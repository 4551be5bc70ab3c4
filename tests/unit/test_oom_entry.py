"""Out-of-memory in every form (`workers.in_rank.oom`), read in this process: the forms are real
exception objects of the installed torch, built the way the allocators and libraries raise them;
the exit report's fields and the device peaks it holds; an abort read from the allocator's counts.
What a real rank process leaves (its exit status, its report, its stderr) is tested in
tests/integration/test_oom_entry_process.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed

from workers.in_rank.device_memory import read_exit_report
from workers.in_rank.oom import aborted_out_of_memory, out_of_memory_cause, stderr_out_of_memory

ALLOCATOR_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB "
                  "of which 1.06 GiB is free.")


def _accelerator_error(code: int | None) -> BaseException:
    exc = torch.AcceleratorError("CUDA error: out of memory" if code == 2 else "CUDA error: an illegal memory access")
    if code is not None:
        exc.error_code = code
    return exc


def _chained(outer: BaseException, inner: BaseException, how: str) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as caught:
            if how == "cause":
                raise outer from caught
            raise outer
    except BaseException as final:
        return final


@pytest.mark.parametrize(
    ("exc", "is_oom"),
    [
        (torch.OutOfMemoryError(ALLOCATOR_TEXT), True),
        (torch.cuda.OutOfMemoryError(ALLOCATOR_TEXT), True),
        (RuntimeError(ALLOCATOR_TEXT), True),  # TorchScript and older torch raise a plain RuntimeError
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (_accelerator_error(2), True),
        (torch.AcceleratorError("CUDA error: out of memory"), True),  # the message, no error_code
        (_accelerator_error(700), False),
        (torch.distributed.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5\n"
            "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nFailed to CUDA calloc 10485760 bytes"),
         True),
        (torch.distributed.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:2030, unhandled cuda error, NCCL version 2.21.5\n"
            "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'"), True),
        (torch.distributed.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:2030, unhandled cuda error, NCCL version 2.27.3\n"
            "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
            "Failed to CUDA call include/alloc.h:126 (ncclCudaCallocAsyncDebug)"), True),
        (torch.distributed.DistBackendError("NCCL error: remote process exited or there was a network error"), False),
        (MemoryError(), True),
        (RuntimeError("Expected all tensors to be on the same device"), False),
        (ValueError("batch too large: out of memory, try a smaller one"), False),  # user advice, not an allocator
        (_chained(SystemExit(1), torch.OutOfMemoryError(ALLOCATOR_TEXT), "context"), True),  # sys.exit in except
        (_chained(RuntimeError("training failed"), torch.OutOfMemoryError(ALLOCATOR_TEXT), "cause"), True),
        (_chained(KeyError("x"), RuntimeError(ALLOCATOR_TEXT), "context"), True),
        (_chained(SystemExit(1), ValueError("bad flag"), "context"), False),
        (None, False),
    ],
)
def test_out_of_memory_in_every_form(exc: BaseException | None, is_oom: bool) -> None:
    assert (out_of_memory_cause(exc) is not None) is is_oom


def test_a_cyclic_chain_ends() -> None:
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__context__, second.__context__ = second, first
    assert out_of_memory_cause(first) is None


def test_report_fields_are_typed(tmp_path: Path) -> None:
    path = tmp_path / "exit.json"
    path.write_text(json.dumps({"peak_device_bytes": "9", "device_ooms": -1, "profiling_exit": "yes",
                                "peak_device_allocated_bytes": 7, "oom": 3}))
    assert read_exit_report(path) == {"peak_device_allocated_bytes": 7}
    assert read_exit_report(tmp_path / "missing.json") == {}


# ---------------------------------------------------------------- an OOM seen only on stderr (a wrapper's script)


#: The end of a real DeepSpeed launch on one H100 (bench/gpu_smoke.sh's run): every line of the rank's output
#: carries the launcher's "[rank0]: " prefix, and the launcher's own line follows the traceback.
H100_STDERR = """[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/main/examples/train_gpt.py", line 65, in <module>
[rank0]:     main()
[rank0]:     ^^^^^^
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.69 GiB. GPU 0 has a total capacity of 79.18 GiB of which 1.78 GiB is free.
[2026-11-25 09:35:12,410] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u', 'train_gpt.py'] exits with return code = 1
"""


def test_launcher_prefixes_and_lines_after_the_traceback_are_allowed() -> None:
    assert stderr_out_of_memory(H100_STDERR).startswith("torch.OutOfMemoryError: CUDA out of memory.")
    other_rank = H100_STDERR.replace("[rank0]: torch.OutOfMemoryError", "[rank0]: KeyError")
    assert stderr_out_of_memory("[rank1]: torch.OutOfMemoryError: CUDA out of memory.\n" + other_rank) is None


def test_the_device_total_and_what_the_allocator_does_not_hold_are_reported(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """The untracked reserve (CUDA context, NCCL, other processes) is measured at the
    end of the run, total - free - reserved, on the busiest device; the memory model still guesses it."""
    import types

    from workers.in_rank import device_memory

    gib = 1 << 30
    # total, free, reserved; device 2 is a gang peer's GPU, visible to this rank, never used by it
    devices = {0: (80 * gib, 60 * gib, 17 * gib), 1: (80 * gib, 70 * gib, 8 * gib), 2: (80 * gib, 20 * gib, 0)}
    asked = []
    cuda = types.SimpleNamespace(
        is_initialized=lambda: True, device_count=lambda: 3,
        memory_stats=lambda d: {"num_alloc_retries": 0, "num_ooms": 0},
        max_memory_reserved=lambda d: devices[d][2], max_memory_allocated=lambda d: max(0, devices[d][2] - gib),
        mem_get_info=lambda d: asked.append(d) or (devices[d][1], devices[d][0]), memory_reserved=lambda d: devices[d][2])
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    peaks = device_memory.measured_peaks()
    assert peaks["device_total_bytes"] == 80 * gib
    assert peaks["device_untracked_bytes"] == 3 * gib  # device 0: 80 - 60 - 17; device 1: 80 - 70 - 8 = 2
    assert asked == [0, 1]  # no CUDA context opened on the peer's GPU, its 60 GiB not taken for ours
    path = tmp_path / "exit.json"
    path.write_text(json.dumps(peaks))
    assert read_exit_report(path) == peaks


class FakeCuda:
    """One device's caching allocator as torch.cuda shows it: current and peak reserved/allocated."""

    def __init__(self) -> None:
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0

    def hold(self, allocated: int, reserved: int) -> None:
        self.allocated, self.reserved = allocated, reserved
        self.peak_allocated, self.peak_reserved = max(self.peak_allocated, allocated), max(self.peak_reserved, reserved)

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def memory_stats(self, device: int) -> dict[str, int]:
        return {"num_alloc_retries": 0, "num_ooms": 0}

    def max_memory_reserved(self, device: int) -> int:
        return self.peak_reserved

    def max_memory_allocated(self, device: int) -> int:
        return self.peak_allocated

    def reset_peak_memory_stats(self, device: int) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return 80 * 2**30 - self.reserved, 80 * 2**30

    def memory_reserved(self, device: int) -> int:
        return self.reserved


def test_building_the_engine_is_kept_apart_from_the_training_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without zero.Init the whole model (30 GiB) reaches the GPU before ZeRO-3
    partitions it down to 6 GiB; training then peaks at 14 GiB allocated. The engine's build is
    hooked (workers.in_rank.step_clock): the build's peak is reported apart, and the training peak is 14,
    not 30. What the allocator keeps cached after the build (10 GiB reserved) is still reserved."""
    import types

    from workers.in_rank import device_memory, step_clock

    gib = 1 << 30
    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(device_memory, "_init_peaks", {})

    class DeepSpeedEngine:
        def __init__(self) -> None:
            cuda.hold(30 * gib, 30 * gib)  # the whole model on the device
            cuda.hold(6 * gib, 10 * gib)  # partitioned; some of the transient stays cached

    step_clock._patch_engine(types.SimpleNamespace(DeepSpeedEngine=DeepSpeedEngine))
    DeepSpeedEngine()
    cuda.hold(14 * gib, 16 * gib)  # training's own peak
    cuda.hold(6 * gib, 16 * gib)
    peaks = device_memory.measured_peaks()
    assert (peaks["peak_device_init_bytes"], peaks["peak_device_init_allocated_bytes"]) == (30 * gib, 30 * gib)
    assert (peaks["peak_device_bytes"], peaks["peak_device_allocated_bytes"]) == (16 * gib, 14 * gib)


def test_only_an_abort_with_an_interim_report_is_read_from_the_counts() -> None:
    counts = {"interim": True, "device_ooms": 2}
    assert aborted_out_of_memory(-6, counts)[0].startswith("the CUDA allocator counted 2 out-of-memory error(s)")
    assert aborted_out_of_memory(-9, counts) == (None, None)  # killed, not aborted: our monitor's kill, a signal
    assert aborted_out_of_memory(1, counts) == (None, None)  # an exit: workers.in_rank.entry read the exception itself
    assert aborted_out_of_memory(-6, {"device_ooms": 2}) == (None, None)  # a final report: entry already decided
