"""What a real rank process leaves when it runs out of memory, crashes or ends: `python -m
workers.in_rank.entry` run as a subprocess, as a rank runs, with its exit status and the report it
leaves (`workers.in_rank.entry`), and the stderr of real processes ended by an exception or by a
SIGABRT as NCCL's watchdog ends a rank, read by `workers.in_rank.oom`. Each test starts an
interpreter (several import torch): seconds each, so they run with the integration tests; the forms
of an OOM read in-process are tested in tests/unit/test_oom_entry.py.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.unit.test_oom_entry import ALLOCATOR_TEXT, H100_STDERR
from workers.in_rank.device_memory import read_exit_report
from workers.in_rank.failure import OOM_EXIT_CODE
from workers.in_rank.oom import aborted_out_of_memory, stderr_out_of_memory

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


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


# ---------------------------------------------------------------- an OOM seen only on stderr (a wrapper's script)


def _stderr_of(code: str) -> str:
    """What a real Python process prints to stderr when `code` ends it."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=False)
    assert proc.returncode != 0
    return proc.stderr


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
