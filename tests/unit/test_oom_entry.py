"""Out-of-memory in every form (`workers.in_rank.oom`) and the exit report of `workers.in_rank.entry`.

The forms are real exception objects of the installed torch, built the way the allocators and
libraries raise them; the entry tests run `python -m workers.in_rank.entry` as a real subprocess, as a rank
does, and read its exit status and the report it leaves.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed

from workers.in_rank.device_memory import read_exit_report
from workers.in_rank.failure import OOM_EXIT_CODE
from workers.in_rank.oom import aborted_out_of_memory, out_of_memory_cause, stderr_out_of_memory

ROOT = Path(__file__).resolve().parents[2]
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


def _run_entry(tmp_path: Path, body: str, extra_files: dict[str, str] | None = None,
               timeout: float = 120) -> tuple[int, dict, str]:
    for name, text in (extra_files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    report = tmp_path / "exit.json"
    done = subprocess.run([sys.executable, "-m", "workers.in_rank.entry", str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                                       "AUTOTUNE_EXIT_REPORT": str(report)})
    return done.returncode, read_exit_report(report), done.stderr


def test_caught_oom_then_exit_1_is_an_oom(tmp_path: Path) -> None:
    code, report, stderr = _run_entry(tmp_path, """
        import sys, traceback, torch
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError:
            traceback.print_exc()
            sys.exit(1)
    """)
    assert code == OOM_EXIT_CODE
    assert report["oom"].startswith("OutOfMemoryError: CUDA out of memory") and report["profiling_exit"] is False
    assert "workers.in_rank.entry: out of memory" in stderr


def test_a_plain_crash_stays_a_crash_with_its_report(tmp_path: Path) -> None:
    code, report, stderr = _run_entry(tmp_path, """
        from workers.in_rank.device_memory import report_peak
        report_peak(3 * 2**30, 2 * 2**30)
        report_peak(2**30)  # a lower later value never lowers the peak
        raise RuntimeError("invalid device ordinal")
    """)
    assert code == 1 and "RuntimeError: invalid device ordinal" in stderr
    assert "up" in report.pop("moments")  # workers.slot.timeline's start of the rank's own clock
    assert isinstance(report.pop("imported"), list)  # for the warm interpreter (workers.warm.warm_start)
    assert isinstance(report.pop("imported_count"), int)  # all it imported: whether to restart the warm process
    assert report == {"peak_device_bytes": 3 * 2**30, "peak_device_allocated_bytes": 2 * 2**30,
                      "profiling_exit": False}


def test_a_clean_run_reports_its_peak(tmp_path: Path) -> None:
    code, report, _ = _run_entry(tmp_path, """
        from workers.in_rank.device_memory import report_peak
        report_peak(5 * 2**30)
    """)
    assert "up" in report.pop("moments")
    assert isinstance(report.pop("imported"), list)
    assert isinstance(report.pop("imported_count"), int)
    assert code == 0 and report == {"peak_device_bytes": 5 * 2**30, "peak_device_allocated_bytes": 5 * 2**30,
                                     "profiling_exit": False}


ENGINE = """
    class DeepSpeedEngine:
        def _autotuning_exit(self):
            exit()
        def train_batch(self):
            self._autotuning_exit()
    def other_exit():
        exit()
"""


@pytest.mark.parametrize(
    ("call", "profiling_exit"),
    [("DeepSpeedEngine().train_batch()", True),  # DeepSpeed's own profiling exit
     ("other_exit()", False),  # an exit elsewhere in DeepSpeed is not the profiling exit
     ("exit()", False)],  # nor is the script's own
)
def test_deepspeeds_profiling_exit_is_recognised_precisely(tmp_path: Path, call: str, profiling_exit: bool) -> None:
    code, report, _ = _run_entry(tmp_path, f"""
        import sys
        sys.path.insert(0, {str(tmp_path / "site")!r})
        from deepspeed.runtime.engine import DeepSpeedEngine, other_exit
        {call}
    """, {"site/deepspeed/__init__.py": "", "site/deepspeed/runtime/__init__.py": "",
          "site/deepspeed/runtime/engine.py": ENGINE})
    assert code == 0 and report["profiling_exit"] is profiling_exit


def test_a_teardown_that_would_hang_after_the_profiling_exit_is_skipped(tmp_path: Path) -> None:
    """After DeepSpeed's profiling exit the rank leaves without the interpreter's teardown: a thread
    that never ends (as a NCCL communicator's abort can) would otherwise keep the process alive past
    the experiment's time limit and turn the measured config into a timeout."""
    code, report, _ = _run_entry(tmp_path, f"""
        import sys, threading
        sys.path.insert(0, {str(tmp_path / "site")!r})
        from deepspeed.runtime.engine import DeepSpeedEngine
        threading.Thread(target=threading.Event().wait).start()  # joined at teardown, never ends
        DeepSpeedEngine().train_batch()
    """, {"site/deepspeed/__init__.py": "", "site/deepspeed/runtime/__init__.py": "",
          "site/deepspeed/runtime/engine.py": ENGINE}, timeout=30)
    assert code == 0 and report["profiling_exit"] is True


def test_a_plain_torch_script_measured_by_workers_metrics_leaves_like_deepspeeds(tmp_path: Path) -> None:
    """`workers.in_rank.metrics` raises SystemExit(0) after the metrics, as DeepSpeed's engine exits: the same
    exit without a teardown (a thread that never ends stands for NCCL's communicators)."""
    metric = tmp_path / "metrics.json"
    code, report, _ = _run_entry(tmp_path, f"""
        import threading
        from workers.in_rank.metrics import AutotuningMetrics
        config = {{"train_micro_batch_size_per_gpu": 1,
                   "autotuning": {{"enabled": True, "metric_path": {str(metric)!r}, "end_profile_step": 2}}}}
        metrics = AutotuningMetrics.from_ds_config(config, rank=0, world_size=1)
        threading.Thread(target=threading.Event().wait).start()  # joined at teardown, never ends
        while True:
            with metrics.timed("fwd"):
                pass
            metrics.end_micro_step()
    """, timeout=30)
    assert code == 0 and report["profiling_exit"] is True and metric.is_file()


def test_report_fields_are_typed(tmp_path: Path) -> None:
    path = tmp_path / "exit.json"
    path.write_text(json.dumps({"peak_device_bytes": "9", "device_ooms": -1, "profiling_exit": "yes",
                                "peak_device_allocated_bytes": 7, "oom": 3}))
    assert read_exit_report(path) == {"peak_device_allocated_bytes": 7}
    assert read_exit_report(tmp_path / "missing.json") == {}


# ---------------------------------------------------------------- an OOM seen only on stderr (a wrapper's script)

def _stderr_of(code: str) -> str:
    """What a real Python process prints to stderr when `code` ends it."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=False)
    assert proc.returncode != 0
    return proc.stderr


#: The end of a real DeepSpeed launch on one H100 (bench/gpu_smoke.sh's run): every line of the rank's output
#: carries the launcher's "[rank0]: " prefix, and the launcher's own line follows the traceback.
H100_STDERR = """[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/main/examples/train_gpt.py", line 65, in <module>
[rank0]:     main()
[rank0]:     ^^^^^^
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.69 GiB. GPU 0 has a total capacity of 79.18 GiB of which 1.78 GiB is free.
[2026-11-25 09:35:12,410] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u', 'train_gpt.py'] exits with return code = 1
"""


@pytest.mark.parametrize(
    ("code", "is_oom"),
    [
        (f"import torch\nraise torch.OutOfMemoryError({ALLOCATOR_TEXT!r})", True),
        (f"import torch\ntorch.ones(1)\nraise RuntimeError({ALLOCATOR_TEXT!r})", True),  # older torch, TorchScript
        ("raise MemoryError()", True),
        ("raise RuntimeError('CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)')", True),
        (f"raise ValueError({ALLOCATOR_TEXT!r})", False),  # a user's error quoting the allocator
        ("import sys\nprint('hint: on CUDA out of memory lower the batch', file=sys.stderr)\nraise KeyError('lr')",
         False),  # advice text, then another error
        (f"""
         import torch
         try:
             raise torch.OutOfMemoryError({ALLOCATOR_TEXT!r})
         except torch.OutOfMemoryError:
             raise ValueError('training failed')
         """, False),  # caught, and the script's own error is what ended it
        (f"""
         import sys, torch
         try:
             raise ValueError('bad batch')
         except ValueError:
             raise torch.OutOfMemoryError({ALLOCATOR_TEXT!r})
         """, True),  # the last traceback is the OOM
        ("import sys\nprint('CUDA out of memory', file=sys.stderr)\nsys.exit(1)", False),  # no traceback
    ],
    ids=["torch-oom", "runtime-error-text", "memory-error", "cublas", "value-error-text", "advice-then-keyerror",
         "oom-caught-then-own-error", "oom-while-handling", "text-without-traceback"],
)
def test_an_oom_is_read_from_stderr_only_as_the_last_tracebacks_exception(code: str, is_oom: bool) -> None:
    found = stderr_out_of_memory(_stderr_of(code))
    assert (found is not None) is is_oom, found


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


# ---------------------------------------------------------------- NCCL's watchdog: a C++ abort, no traceback

#: What torch's NCCL watchdog prints when a collective's CUDA allocation failed, before libstdc++
#: aborts the process (SIGABRT; the shape of pytorch#126544's and Megatron-LM#935's logs).
WATCHDOG = """[rank1]:[E1125 10:00:00.000000 ProcessGroupNCCL.cpp:1414] [PG 0 Rank 1] Process group watchdog thread \
terminated with exception: NCCL error in: ProcessGroupNCCL.cpp:2030, unhandled cuda error (run with NCCL_DEBUG=INFO \
for details), NCCL version 2.21.5
[rank1]:ncclUnhandledCudaError: Call to CUDA function failed.
[rank1]:Last error:
[rank1]:{last}
[rank1]:Exception raised from checkForNCCLErrorsInternal at ProcessGroupNCCL.cpp:1941 (most recent call first):
[rank1]:frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 (0x7f in libc10.so)
terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG 0 Rank 1] Process group watchdog thread terminated with exception: NCCL error in: \
ProcessGroupNCCL.cpp:2030, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5
ncclUnhandledCudaError: Call to CUDA function failed.
Last error:
{last}
Exception raised from checkForNCCLErrorsInternal at ProcessGroupNCCL.cpp:1941 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 (0x7f in libc10.so)
"""
TIMEOUT_ABORT = """terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG 1 Rank 1] Process group watchdog thread terminated with exception: [Rank 1] Watchdog caught \
collective operation timeout: WorkNCCL(SeqNum=199, OpType=_REDUCE_SCATTER_BASE, Timeout(ms)=600000) ran for 600000 \
milliseconds before timing out.
Exception raised from checkTimeout at ProcessGroupNCCL.cpp:565 (most recent call first):
"""


def _aborted_with(text: str) -> str:
    """The stderr of a real process that prints `text` and dies of SIGABRT, as the watchdog ends a rank."""
    code = f"import os, sys\nsys.stderr.write({text!r})\nsys.stderr.flush()\nos.abort()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == -6  # SIGABRT: no Python exception, no exit report
    return proc.stderr


@pytest.mark.parametrize(
    ("text", "is_oom"),
    [
        (WATCHDOG.format(last="Cuda failure 'out of memory'"), True),
        (WATCHDOG.format(last="Cuda failure 2 'out of memory'"), True),
        (WATCHDOG.format(last="Failed to CUDA calloc async 4194304 bytes"), True),
        (WATCHDOG.format(last="Failed to CUDA call include/alloc.h:126 (ncclCudaCallocAsyncDebug)"), True),
        (WATCHDOG.format(last="Cuda failure 'an illegal memory access was encountered'"), False),
        (TIMEOUT_ABORT, False),  # a collective that timed out: a hang, not memory
        (f"hint: CUDA out of memory? lower the batch\n{TIMEOUT_ABORT}", False),  # advice before another abort
        # an OOM traceback, then the watchdog's abort for a timeout: the last fatal report decides
        (H100_STDERR + TIMEOUT_ABORT, False),
        # the watchdog's OOM abort last, after an earlier traceback of something else
        ("Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'lr'\n"
         + WATCHDOG.format(last="Cuda failure 'out of memory'"), True),
    ],
    ids=["cuda-failure", "cuda-failure-2", "calloc-async", "nccl-calloc-call", "illegal-access", "timeout",
         "advice-then-timeout", "oom-traceback-then-timeout-abort", "traceback-then-oom-abort"],
)
def test_an_oom_that_nccls_watchdog_turned_into_an_abort_is_read_from_stderr(text: str, is_oom: bool) -> None:
    found = stderr_out_of_memory(_aborted_with(text))
    assert (found is not None) is is_oom, found
    if is_oom:
        assert found.startswith("c10::DistBackendError: [PG 0 Rank 1] Process group watchdog")


# ---------------------------------------------------------------- a process that aborts (no report at its end)

#: torch.cuda as a rank on a GPU shows it, in a script that then aborts as NCCL's watchdog makes it.
ABORTING_ON_A_GPU = """
    import os, sys, time, types
    stats = {{"num_alloc_retries": {retries}, "num_ooms": {ooms}}}
    sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(
        is_initialized=lambda: True, device_count=lambda: 1, memory_stats=lambda d: stats,
        max_memory_reserved=lambda d: 6 << 30, max_memory_allocated=lambda d: 5 << 30,
        memory_reserved=lambda d: 6 << 30, mem_get_info=lambda d: (1 << 30, 8 << 30)))
    time.sleep({seconds})
    {end}
"""


@pytest.mark.parametrize(("ooms", "retries", "oom", "probable"), [(1, 3, True, False), (0, 3, False, True),
                                                                   (0, 0, False, False)])
def test_a_rank_that_aborts_leaves_the_allocators_counts_behind(tmp_path: Path, ooms: int, retries: int,
                                                                oom: bool, probable: bool) -> None:
    """Torch's NCCL watchdog ends a rank with SIGABRT, which writes no report at the
    end; the interim report, written while the script ran, still tells what the allocator saw."""
    code, report, _ = _run_entry(tmp_path, ABORTING_ON_A_GPU.format(ooms=ooms, retries=retries, seconds=2.6,
                                                                    end="os.abort()"))
    assert code == -6 and report["interim"] is True and report["peak_device_bytes"] == 6 << 30
    assert (report.get("device_ooms", 0), report.get("device_alloc_retries", 0)) == (ooms, retries)
    certain, likely = aborted_out_of_memory(code, report)
    assert (certain is not None, likely is not None) == (oom, probable)


def test_the_final_report_replaces_the_interim_one(tmp_path: Path) -> None:
    code, report, _ = _run_entry(tmp_path, ABORTING_ON_A_GPU.format(ooms=0, retries=0, seconds=2.6, end="pass"))
    assert code == 0 and "interim" not in report and report["profiling_exit"] is False


def test_a_cpu_rank_writes_no_interim_report(tmp_path: Path) -> None:
    code, report, _ = _run_entry(tmp_path, "import os, time\ntime.sleep(2.6)\nos.abort()\n")
    assert code == -6 and report == {}


def test_only_an_abort_with_an_interim_report_is_read_from_the_counts() -> None:
    counts = {"interim": True, "device_ooms": 2}
    assert aborted_out_of_memory(-6, counts)[0].startswith("the CUDA allocator counted 2 out-of-memory error(s)")
    assert aborted_out_of_memory(-9, counts) == (None, None)  # killed, not aborted: our monitor's kill, a signal
    assert aborted_out_of_memory(1, counts) == (None, None)  # an exit: workers.in_rank.entry read the exception itself
    assert aborted_out_of_memory(-6, {"device_ooms": 2}) == (None, None)  # a final report: entry already decided
