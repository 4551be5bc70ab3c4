"""A warm interpreter per slot (workers.warm.warm_start), with real forkservers, real torch and
`workers.process.launch.run_watched`: a forked rank is what a cold one is, everything that finds, limits
and kills a rank still works, CUDA never reaches a fork, and what the warm path cannot serve runs
cold and says why."""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from integration_helpers import run_autotune, write_config
from workers.in_rank.failure import KillReason
from workers.process.launch import LaunchResult, group_alive, run_watched
from workers.warm.warm_plan import SWITCH_ENV, installed_roots
from workers.warm.warm_server import UNTOLD_EXIT
from workers.warm.rank_start import Start
from workers.warm.warm_start import NOTHING_TO_PRELOAD, WarmStarts

ROOT = Path(__file__).resolve().parents[2]

PROBE = '''
import atexit, json, multiprocessing, os, sys
import torch
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "rank": os.environ.get("RANK"), "path": sys.path[:2],
                  "threads": torch.get_num_threads(), "cuda": torch.cuda.is_initialized(),
                  "process": multiprocessing.current_process().name, "daemon": multiprocessing.current_process().daemon,
                  "main": __name__, "file": __file__}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
'''


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("AUTOTUNE_")}
    env.update({"PYTHONPATH": f"{ROOT}:{tmp_path / 'site'}", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "AUTOTUNE_SLOT": "test.gpu0", "CUDA_VISIBLE_DEVICES": "", "RANK": "0",
                "DS_ACCELERATOR": "cpu", SWITCH_ENV: "1", **extra})
    return env


def _launch(warm: WarmStarts, tmp_path: Path, script: Path, *args: str, env: dict[str, str] | None = None,
            **watch: object) -> tuple[LaunchResult, Start, str, str]:
    command = [sys.executable, "-m", "workers.in_rank.entry", str(script), *args] if script.suffix == ".py" \
        else [str(script), *args]
    env = env or _env(tmp_path)
    start = Start()
    result = run_watched(command, env=env, cwd=str(tmp_path), stdout_path=tmp_path / "out.log",
                         stderr_path=tmp_path / "err.log", timeout_s=watch.pop("timeout_s", 180),
                         memory_cap_bytes=watch.pop("memory_cap_bytes", None),
                         spawn=warm.spawn_for(command[3:] if script.suffix == ".py" else command, env, "cpu", (), start),
                         **watch)
    return result, start, (tmp_path / "out.log").read_text(), (tmp_path / "err.log").read_text()


@pytest.fixture
def warm(tmp_path: Path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "installed_lib.py").write_text("")  # a script of the standard library alone runs cold
    starts = WarmStarts(roots=[*installed_roots(), (tmp_path / "site").resolve()])
    yield starts
    starts._stop_server()


def test_a_forked_rank_is_what_a_cold_one_is(warm: WarmStarts, tmp_path: Path) -> None:
    """argv, cwd, environment, sys.path, torch's threads, __main__, stdout/stderr, exit status and
    atexit: the same warm as cold; and the second launch reuses the warm process."""
    import json

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    seen = {}
    for path, env in (("cold", _env(tmp_path, **{SWITCH_ENV: "0"})), ("warm", _env(tmp_path)),
                      ("warm", _env(tmp_path, RANK="3"))):
        result, start, out, err = _launch(warm, tmp_path, script, "7", env=env)
        assert start.path == path, start.why_cold
        assert result.exit_code == 7 and "to stderr" in err and out.endswith("atexit ran\n"), (out, err)
        seen.setdefault(path, []).append(json.loads(out.splitlines()[0]))
    cold, (warm_first, warm_again) = seen["cold"][0], seen["warm"]
    assert warm_first == cold
    assert cold["argv"] == [str(script), "7"] and cold["cwd"] == str(tmp_path) and cold["threads"] == 1
    assert cold["path"] == [str(tmp_path), str(tmp_path)] and cold["process"] == "MainProcess" and not cold["daemon"]
    assert warm_again["rank"] == "3"  # the rank's environment, not the one the warm process started with


def test_the_second_warm_launch_skips_the_imports(warm: WarmStarts, tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    _launch(warm, tmp_path, script, "0")  # starts the warm process
    began = time.monotonic()
    result, start, _, _ = _launch(warm, tmp_path, script, "0")
    warm_s = time.monotonic() - began
    began = time.monotonic()
    cold_result, _, _, _ = _launch(warm, tmp_path, script, "0", env=_env(tmp_path, **{SWITCH_ENV: "0"}))
    cold_s = time.monotonic() - began
    assert start.path == "warm" and result.exit_code == 0 == cold_result.exit_code
    assert warm_s < cold_s / 2, (warm_s, cold_s)


#: What a rank of a DeepSpeed script on CPU finds at its start: DeepSpeed's probe of the ops the
#: machine can build (a C compiler run) and its communication op already done in the warm process,
#: and whether the op works (DeepSpeed's own load, then a call into it).
DEEPSPEED_PREPARED = ("import deepspeed.ops\nfrom deepspeed.ops.op_builder.builder import OpBuilder\n"
                      "print('probed' if '__compatible_ops__' in vars(deepspeed.ops) else 'not probed')\n"
                      "print('loaded' if 'deepspeed_shm_comm' in OpBuilder._loaded_ops else 'not loaded')\n"
                      "from deepspeed.comm.torch import build_shm_op\nop = build_shm_op()\n"
                      "print('works' if op.vector_kernel_level() is not None else 'broken')\n")


def test_a_deepspeed_rank_on_cpu_finds_the_ops_probed_and_the_communication_op_loaded(
        warm: WarmStarts, tmp_path: Path) -> None:
    """`deepspeed.initialize` probed every op builder (70 ms) and loaded the shared-memory
    communication op (two subprocesses) in every rank; the warm process does both once, the op
    imported from what the slot worker built. A cold rank still does them itself. A lock in the
    op's folder (a build running, or killed) leaves the op to the rank: torch would wait on it."""
    from workers.slot.build_locks import default_extensions_dir

    script = tmp_path / "prepared.py"
    script.write_text(DEEPSPEED_PREPARED)
    env = _env(tmp_path, TORCH_EXTENSIONS_DIR=default_extensions_dir())
    result, start, out, err = _launch(warm, tmp_path, script, env=env)
    assert result.exit_code == 0 and start.path == "warm", (start.why_cold, err)
    assert out.split()[:2] == ["probed", "loaded"] and "works" in out, err
    result, start, out, err = _launch(warm, tmp_path, script, env={**env, SWITCH_ENV: "0"})
    assert result.exit_code == 0 and start.path == "cold", err
    assert out.split()[:4] == ["not", "probed", "not", "loaded"] and "works" in out, err


def test_a_lock_in_the_ops_folder_leaves_the_op_to_the_rank(tmp_path: Path) -> None:
    """A build running, or one killed that left its lock: torch's JIT path would wait on it, and
    the warm process's start with it; the warm process leaves the op alone."""
    import shutil
    import subprocess

    from workers.slot.build_locks import default_extensions_dir

    copy = tmp_path / "extensions"
    shutil.copytree(default_extensions_dir(), copy)
    code = "from workers.warm.warm_preload import prepare_deepspeed_ops; print(prepare_deepspeed_ops())"
    env = {key: value for key, value in os.environ.items() if not key.startswith("AUTOTUNE_")}
    env.update(PYTHONPATH=str(ROOT), TORCH_EXTENSIONS_DIR=str(copy), DS_ACCELERATOR="cpu")
    free = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    (copy / "deepspeed_shm_comm" / "lock").touch()
    locked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert free.stdout.strip().endswith("probed, communication op loaded"), free.stdout + free.stderr
    assert "left to each rank" in locked.stdout.strip().splitlines()[-1], locked.stdout + locked.stderr


def test_torch_takes_its_thread_count_from_the_rank(tmp_path: Path) -> None:
    """OMP_NUM_THREADS is read when torch loads: a rank forked from a process that loaded it with
    another value sets torch's own count (workers.warm.warm_start._as_a_fresh_process)."""
    import subprocess

    code = ("import torch; torch.set_num_threads(2); from workers.warm.warm_rank import _as_a_fresh_process; "
            "_as_a_fresh_process({'OMP_NUM_THREADS': '1'}); print(torch.get_num_threads())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "1", done.stderr


def test_a_preload_that_initialises_cuda_is_dropped_and_said_so(warm: WarmStarts, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A stand-in for a library that initialises CUDA when imported (torch's flag set, as a real
    initialisation sets it): the warm process is started again without it, the rank runs warm,
    imports it itself, and the log names it."""
    (tmp_path / "site" / "grabs_cuda.py").write_text("import torch\ntorch.cuda._initialized = True\n")
    script = tmp_path / "uses.py"
    script.write_text("import grabs_cuda\nimport torch\nprint('cuda', torch.cuda.is_initialized())\n")
    with caplog.at_level(logging.WARNING, logger="workers.warm.warm_start"):
        result, start, out, err = _launch(warm, tmp_path, script)
    assert result.exit_code == 0, err
    assert start.path == "warm", start.why_cold
    assert out == "cuda True\n"  # imported in the rank, where it belongs
    assert "preloading grabs_cuda initialised CUDA in the warm process (seen: torch.cuda.is_initialized())" \
        in caplog.text


def test_cuda_initialised_in_the_warm_process_after_its_preload_stops_the_fork(warm: WarmStarts,
                                                                               tmp_path: Path) -> None:
    """The check before every fork: a library whose thread initialises CUDA a while after it was
    imported passes the preload's check, but the next fork's rank refuses and the launch runs cold."""
    (tmp_path / "site" / "late_cuda.py").write_text(textwrap.dedent("""
        import threading, time, torch
        def grab():
            time.sleep(2.0)
            torch.cuda._initialized = True
        threading.Thread(target=grab, daemon=True).start()
    """))
    script = tmp_path / "uses.py"
    script.write_text("import late_cuda\nprint('ran')\n")
    result, start, out, _ = _launch(warm, tmp_path, script)
    assert result.exit_code == 0 and out == "ran\n"
    if start.path == "warm":  # the first fork beat the thread: the next one does not
        time.sleep(2.5)
        result, start, out, _ = _launch(warm, tmp_path, script)
    assert start.path == "cold" and "CUDA was initialised in the warm process" in start.why_cold
    assert result.exit_code == 0 and out == "ran\n"


def test_a_preload_that_initialises_cuda_without_torch_is_dropped(warm: WarmStarts, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """pycuda.autoinit or CuPy initialise the driver without torch knowing: a stand-in leaves the
    driver's state as /proc shows it after cuInit (the unified-memory device open), and is dropped
    from the preload as one that set torch's flag is; the rank imports it itself."""
    (tmp_path / "site" / "grabs_driver.py").write_text(
        "import workers.warm.warm_preload as preload\npreload._proc_view = lambda: ('', ['/dev/nvidia-uvm'])\n")
    script = tmp_path / "uses.py"
    script.write_text("import grabs_driver, installed_lib\nprint('ran')\n")
    with caplog.at_level(logging.WARNING, logger="workers.warm.warm_start"):
        result, start, out, err = _launch(warm, tmp_path, script)
    assert result.exit_code == 0 and out == "ran\n", err
    assert start.path == "warm", start.why_cold
    assert "preloading grabs_driver initialised CUDA in the warm process (seen: /dev/nvidia-uvm open)" in caplog.text


def test_the_warm_process_is_started_again_when_its_code_changed_on_disk(warm: WarmStarts, tmp_path: Path) -> None:
    """A module the warm process imported, edited (or reinstalled) under the running worker: the next
    rank gets a fresh warm process with the new code, not the old module from memory; unchanged,
    the warm process is reused."""
    lib = tmp_path / "site" / "installed_lib.py"
    lib.write_text("VERSION = 1\n")
    script = tmp_path / "uses.py"
    script.write_text("import installed_lib\nprint(installed_lib.VERSION)\n")
    outs, servers = [], []
    for edit in (None, None, "VERSION = 2\n"):
        if edit:
            lib.write_text(edit)
            later = os.stat(lib).st_mtime_ns + 10**9
            os.utime(lib, ns=(later, later))
        result, start, out, err = _launch(warm, tmp_path, script)
        assert result.exit_code == 0 and start.path == "warm", (start.why_cold, err)
        outs.append(out)
        servers.append(warm._pid)
    assert outs == ["1\n", "1\n", "2\n"]
    assert servers[0] == servers[1] != servers[2]


def test_a_warm_process_killed_mid_rank_leaves_the_rank_running_and_its_end_untold(warm: WarmStarts,
                                                                                   tmp_path: Path) -> None:
    """The warm process SIGKILLed (the OOM killer) while its rank runs: the rank is not taken as
    exited 255 and killed; it is watched by its pid to its end, whose status nobody can tell, so
    `Start.lost` says why (workers.slot.rank records the launch lost, to be launched again)."""
    done = tmp_path / "done"
    script = tmp_path / "long.py"
    script.write_text("import sys, time, installed_lib\nprint('up', flush=True)\ntime.sleep(4)\n"
                      "open(sys.argv[1], 'w').write('done')\n")
    killed: list[int] = []

    def kill_the_warm_process(_pgid: int) -> None:
        def later() -> None:
            time.sleep(1.0)
            killed.append(warm._pid)
            os.kill(warm._pid, signal.SIGKILL)
        threading.Thread(target=later, daemon=True).start()

    result, start, out, err = _launch(warm, tmp_path, script, str(done), on_start=kill_the_warm_process)
    assert killed and start.path == "warm", start.why_cold
    assert done.read_text() == "done", "the rank was stopped with its warm process"
    assert result.killed_for is None and result.exit_code == UNTOLD_EXIT
    assert "died while it ran" in start.lost and "recorded lost" in err
    assert result.wall_s >= 3.5


def test_the_wait_for_the_warm_process_is_the_launchs_own(warm: WarmStarts, tmp_path: Path) -> None:
    """`prepare` waits for the warm process before the rank's time limit starts and says how long,
    for workers.slot.rank to take it from the limit; a preload not done within the limit leaves the rank
    cold at once and is finished for the next launch, which finds it ready."""
    (tmp_path / "site" / "slow_lib.py").write_text("import time\ntime.sleep(3.0)\n")
    script = tmp_path / "slow.py"
    script.write_text("import slow_lib\nprint('ran')\n")
    env = _env(tmp_path)

    def prepared(limit_s: float) -> tuple[float, Start, LaunchResult, float]:
        start = Start()
        waited = warm.prepare([str(script)], env, str(tmp_path), "cpu", limit_s, start)
        began = time.monotonic()
        result = run_watched([sys.executable, "-m", "workers.in_rank.entry", str(script)], env=env, cwd=str(tmp_path),
                             stdout_path=tmp_path / "out.log", stderr_path=tmp_path / "err.log", timeout_s=60,
                             memory_cap_bytes=None, spawn=warm.spawn_for([str(script)], env, "cpu", (), start))
        return waited, start, result, time.monotonic() - began

    waited, start, result, ran_s = prepared(180.0)
    assert waited >= 3.0 and start.path == "warm" and result.exit_code == 0, start.why_cold
    assert result.wall_s < 2.0, "the spawn waited for the preload after prepare had"
    warm._stop_server()
    waited, start, result, _ = prepared(1.0)
    assert 1.0 <= waited < 2.5 and start.path == "cold" and "not done" in start.why_cold, (waited, start)
    assert result.exit_code == 0
    time.sleep(3.0)  # the preload finishes meanwhile
    waited, start, result, _ = prepared(180.0)
    assert waited < 2.0 and start.path == "warm" and result.exit_code == 0, (waited, start.why_cold)


@pytest.mark.parametrize("case", ["wrapper", "switched off", "failing preload", "standard library only"])
def test_what_the_warm_path_cannot_serve_runs_cold_and_says_why(warm: WarmStarts, tmp_path: Path, case: str) -> None:
    env = _env(tmp_path)
    if case == "wrapper":
        script = tmp_path / "run.sh"
        script.write_text("#!/bin/sh\necho ran\n")
        script.chmod(0o755)
        expected = "not a Python script"
    else:
        script = tmp_path / "train.py"
        script.write_text("import broken_lib\nprint('ran')\n" if case == "failing preload" else "print('ran')\n")
        (tmp_path / "site" / "broken_lib.py").write_text("import os\nif 'RANK' not in os.environ:\n"
                                                         "    raise RuntimeError('needs RANK')\n")
        if case == "switched off":
            env[SWITCH_ENV] = "0"
        expected = {"failing preload": "a preload failed", "switched off": "switched off",
                    "standard library only": NOTHING_TO_PRELOAD}[case]
    result, start, out, err = _launch(warm, tmp_path, script, env=env)
    assert result.exit_code == 0 and out == "ran\n", err
    assert start.path == "cold" and expected in start.why_cold
    if case == "standard library only":
        assert warm._pid == 0, "a warm process was started for a script that needs none"


ESCAPER = '''
import os, sys, time, installed_lib
pid_file = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        time.sleep(300)
    os._exit(0)
while not os.path.exists(pid_file):
    time.sleep(0.02)
'''


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_forked_setsid_grandchild_is_stopped_with_its_warm_rank(warm: WarmStarts, tmp_path: Path) -> None:
    """No exec anywhere: the grandchild's /proc environ is the warm process's, not the launch's
    token, so the warm process's own token finds it."""
    script = tmp_path / "escape.py"
    script.write_text(ESCAPER)
    result, start, _, err = _launch(warm, tmp_path, script, str(tmp_path / "grandchild.pid"))
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    try:
        assert start.path == "warm" and result.exit_code == 0, err
        deadline = time.monotonic() + 5
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild), "the setsid grandchild outlived its warm rank"
        assert warm._alive(), "the warm process itself was stopped with the rank"
    finally:
        if _alive(grandchild):
            psutil.Process(grandchild).kill()


GROWER = '''
import sys, time
import torch
hold = []
while True:
    hold.append(bytearray(50 * 2**20))
    time.sleep(0.05)
'''


def test_the_memory_cap_and_the_figure_are_a_cold_ranks(warm: WarmStarts, tmp_path: Path) -> None:
    """A warm rank shares the warm process's imports; that memory is counted as its own, as a cold
    rank owns it: the peak of a script that imports what the warm process preloaded (torch,
    DeepSpeed and torch._dynamo, which any torch optimizer imports) and then holds 400 MiB is
    within 15 % of cold's (a cold rank's import transient is the rest), and the cap still stops it."""
    script = tmp_path / "idle.py"
    script.write_text("import time, torch, deepspeed, torch._dynamo\nheld = bytearray(400 * 2**20)\ntime.sleep(3)\n")
    peaks = {}
    for path, env in (("cold", _env(tmp_path, **{SWITCH_ENV: "0"})), ("warm", _env(tmp_path)),
                      ("warm", _env(tmp_path))):
        result, start, _, err = _launch(warm, tmp_path, script, env=env)
        assert result.exit_code == 0 and start.path == path, err
        peaks[path] = result.peak_rss_bytes
    assert abs(peaks["warm"] - peaks["cold"]) < 0.15 * peaks["cold"], peaks
    grower = tmp_path / "grow.py"
    grower.write_text(GROWER)
    result, start, _, _ = _launch(warm, tmp_path, grower, memory_cap_bytes=peaks["cold"] + 400 * 2**20)
    assert start.path == "warm" and result.killed_for is KillReason.MEMORY and result.exit_code < 0


def test_a_stopped_warm_rank_is_killed_with_its_group(warm: WarmStarts, tmp_path: Path) -> None:
    """A peer's failure (or Ctrl-C's teardown) stops a warm rank as it stops a cold one."""
    script = tmp_path / "sleep.py"
    script.write_text("import time, installed_lib\nprint('up', flush=True)\ntime.sleep(300)\n")
    groups: list[int] = []
    started = []  # from the rank's start: the first launch also starts the warm process
    result, start, out, _ = _launch(warm, tmp_path, script,
                                    should_abort=lambda: bool(started) and time.monotonic() - started[0] > 3,
                                    on_start=lambda pgid: (groups.append(pgid), started.append(time.monotonic())))
    assert start.path == "warm" and out == "up\n"
    assert result.killed_for is KillReason.PEER_FAILED and result.exit_code is not None and result.exit_code < 0
    assert not group_alive(groups[0])


def test_an_interrupted_script_ends_as_pythons_does(warm: WarmStarts, tmp_path: Path) -> None:
    """An uncaught KeyboardInterrupt: traceback on stderr, killed by SIGINT, as `python script.py`."""
    script = tmp_path / "interrupted.py"
    script.write_text("import installed_lib\nraise KeyboardInterrupt\n")
    cold, _, _, cold_err = _launch(warm, tmp_path, script, env=_env(tmp_path, **{SWITCH_ENV: "0"}))
    result, start, _, err = _launch(warm, tmp_path, script)
    assert start.path == "warm" and result.exit_code == cold.exit_code == -2
    assert "KeyboardInterrupt" in err and "KeyboardInterrupt" in cold_err


def _imports_lazily(tmp_path: Path, lib_source: str) -> tuple[Path, dict[str, str]]:
    """A script that says whether `lazy_lib` (installed, `lib_source`) was preloaded, then imports it
    inside a function (not at its top level), and an environment that collects its exit report."""
    (tmp_path / "site" / "lazy_lib.py").write_text(lib_source)
    script = tmp_path / "lazy.py"
    script.write_text("import sys, installed_lib\ndef main():\n    print('preloaded' if 'lazy_lib' in sys.modules else 'not yet')\n"
                      "    import lazy_lib\nmain()\n")
    return script, _env(tmp_path, AUTOTUNE_EXIT_REPORT=str(tmp_path / "exit.json"))


def test_what_a_rank_imported_itself_is_preloaded_for_the_next(warm: WarmStarts, tmp_path: Path) -> None:
    """torch and DeepSpeed import much lazily, inside deepspeed.initialize: an installed module the
    script's run imported (not at its top level) is in the warm process for the next rank, and
    the warm process was started again with it right after the rank that taught it."""
    from workers.in_rank.device_memory import read_exit_report

    script, env = _imports_lazily(tmp_path, "import time\ntime.sleep(3.0)\n")
    first, start, out, err = _launch(warm, tmp_path, script, env=env)
    assert first.exit_code == 0 and start.path == "warm" and out == "not yet\n", err
    imported = read_exit_report(tmp_path / "exit.json").get("imported")
    assert "lazy_lib" in imported and "lazy" not in imported  # the script's own module is never preloaded
    server, began = warm._pid, time.monotonic()
    warm.learn([str(script)], imported)
    assert time.monotonic() - began < 2.0, "the rank's task waited for the new warm process's 3 s preload"
    assert warm._pid != server and warm._alive()  # started again at once, between the launches
    second, start, out, err = _launch(warm, tmp_path, script, env=env)
    assert second.exit_code == 0 and start.path == "warm" and out == "preloaded\n", err


def test_a_rank_that_imported_a_few_modules_itself_does_not_restart_the_warm_process(warm: WarmStarts,
                                                                                      tmp_path: Path) -> None:
    """A start of the warm process costs the slot seconds of a core (torch's import again): a lesson
    of a few modules waits for the next start, and is preloaded from then on."""
    from workers.in_rank.device_memory import read_exit_report
    from workers.warm.warm_start import RESTART_AT_IMPORTS

    script, env = _imports_lazily(tmp_path, "")
    _, start, out, err = _launch(warm, tmp_path, script, env=env)
    assert start.path == "warm" and out == "not yet\n", err
    report = read_exit_report(tmp_path / "exit.json")
    assert "lazy_lib" in report["imported"] and report["imported_count"] < RESTART_AT_IMPORTS
    server = warm._pid
    warm.learn([str(script)], report["imported"], imported_count=report["imported_count"])
    assert warm._pid == server  # not started again for one module
    _, start, out, _ = _launch(warm, tmp_path, script, env=env)
    assert warm._pid == server and start.path == "warm" and out == "not yet\n", (warm._pid, server, warm._key)
    warm._stop_server()  # the next launch starts it anyway: with the lesson
    _, start, out, _ = _launch(warm, tmp_path, script, env=env)
    assert start.path == "warm" and out == "preloaded\n"


def test_the_slots_lease_is_kept_while_the_warm_process_starts(warm: WarmStarts, tmp_path: Path) -> None:
    """A preload from a shared filesystem takes tens of seconds: the launch's keep-alive (the lease
    renewal, workers.slot.rank) is called every second meanwhile, or the slot would be taken as lost."""
    (tmp_path / "site" / "slow_lib.py").write_text("import time\ntime.sleep(3.0)\n")
    script = tmp_path / "slow.py"
    script.write_text("import slow_lib\nprint('ran')\n")
    env, calls = _env(tmp_path), []
    start = Start()
    command = [sys.executable, "-m", "workers.in_rank.entry", str(script)]
    result = run_watched(command, env=env, cwd=str(tmp_path), stdout_path=tmp_path / "out.log",
                         stderr_path=tmp_path / "err.log", timeout_s=180, memory_cap_bytes=None,
                         spawn=warm.spawn_for(command[3:], env, "cpu", (), start, lambda: calls.append(1)))
    assert result.exit_code == 0 and start.path == "warm", start.why_cold
    assert len(calls) >= 3  # the preload's 3 s (and torch's import) at one call a second


def test_every_rank_of_a_real_job_runs_warm_by_default(tmp_path: Path) -> None:
    """Under Celery's pool (billiard's authkey once made every rank silently cold), the switch left
    unset on the embedded cluster: every rank forked warm, and the summary counts them."""
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2])
    assert SWITCH_ENV not in os.environ  # the default, not a switch the test run was given
    proc = run_autotune([str(cfg), "--slots", "2", "--num_gpus", "1"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    names = [json.loads(line)["name"] for line in (results / "results.jsonl").read_text().splitlines()]
    ranks = [rank for name in names for rank in json.loads((results / name / "result.json").read_text())["ranks"]]
    assert ranks and {rank.get("start_path") for rank in ranks} == {"warm"}, [r.get("cold_because") for r in ranks]
    summary = (results / "summary.txt").read_text()
    assert "cold: 0." in summary and "ranks started warm: " in summary


KILLS_ITS_WARM_PARENT = '''
import argparse, json, os, sys, time
from pathlib import Path
import psutil

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", required=True)
args, _ = parser.parse_known_args()
autotuning = json.loads(Path(args.deepspeed_config).read_text()).get("autotuning", {})
once = Path(__file__).with_name("killed_its_warm_parent")
if "workers.warm.warm_rank" in sys.modules and not once.exists():  # forked: its parent is the warm process
    once.write_text(str(os.getppid()))
    psutil.Process(os.getppid()).kill()  # as the OOM killer would
    time.sleep(1.0)
if int(os.environ["RANK"]) == 0:
    out = autotuning.get("model_info_path") if autotuning.get("model_info", {}).get("profile") else autotuning["metric_path"]
    Path(out).write_text(json.dumps({"throughput": 100.0, "latency": 10.0, "FLOPS_per_gpu": 1e9, "num_params": 1000,
                                     "trainable_num_params": 1000, "activation_mem_per_gpu": 2**20}))
'''


def test_a_warm_process_killed_mid_rank_is_a_lost_launch_not_a_crashed_config(tmp_path: Path) -> None:
    """On the embedded cluster: the first rank kills its warm process (its parent) and runs on. The
    launch is recorded lost and launched again (warm, from a new warm process), so every record is
    `ok`; read as the rank's exit 255, it was a crashed config."""
    script = tmp_path / "kills_parent.py"
    script.write_text(KILLS_ITS_WARM_PARENT)
    cfg = write_config(tmp_path / "cfg.json", autotuning={"enabled": True, "metric": "throughput",
                                                           "user_script": str(script)})
    proc = run_autotune([str(cfg), "--slots", "1", "--num_gpus", "1"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "killed_its_warm_parent").exists(), "no rank ran warm"
    records = [json.loads(path.read_text()) for path in (tmp_path / "autotuning_results").glob("*/result.json")]
    assert records and {record["status"] for record in records} == {"ok"}, \
        [(record["name"], record["status"], record.get("cause")) for record in records]

