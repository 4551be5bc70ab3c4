"""DeepSpeed's ops built before the script by a real child interpreter (workers.slot.op_prebuild):
the child builds them with the rank's environment, outside the experiment's limits, and reports an
op that cannot be built in the record's words; a stopped launch or a time limit ends it, group and
lock included. Each test starts the child, which imports DeepSpeed: seconds each, so they run with
the integration tests; which ops a config needs is tested in tests/unit/test_op_prebuild.py."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from workers.files import layout
from workers.slot import op_prebuild
from workers.slot.op_prebuild import missing_ops, prebuild_ops

pytestmark = pytest.mark.integration


def failing_compiler(folder: Path) -> Path:
    """A C++ compiler that answers torch's version check and fails every compile, as a node without
    the CUDA toolkit fails FusedAdam's."""
    compiler = folder / "no-cuda-c++"
    compiler.write_text('#!/bin/sh\ncase "$1" in --version|-v) echo "g++ (Debian 12.2.0-14) 12.2.0"; exit 0;; esac\n'
                        'echo "fatal error: cuda_runtime.h: No such file or directory" >&2\nexit 1\n')
    compiler.chmod(0o755)
    return compiler


def _env(extensions: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "DS_ACCELERATOR": "cpu", "MAX_JOBS": "1", **extra}


def test_an_op_that_cannot_be_built_is_reported_before_any_training(tmp_path: Path) -> None:
    """A node whose compiler fails (as nvcc is missing on a GPU node): DeepSpeed's real builder runs
    in the child, fails, and the failure comes back in the words `workers.in_rank.op_build` gives it."""
    log = tmp_path / "rank.op_prebuild.log"
    broken = _env(tmp_path / "ext", CXX=str(failing_compiler(tmp_path)))
    failure = prebuild_ops(["FusedAdamBuilder"], broken, log)
    again = tmp_path / "again.log"  # the next experiment on this worker: the failure remembered, no child
    assert prebuild_ops(["FusedAdamBuilder"], broken, again) == failure
    assert not again.exists()
    assert failure is not None and failure.startswith("fused_adam: RuntimeError: Error building extension 'fused_adam'")
    assert "cuda_runtime.h: No such file" in log.read_text()  # the compiler's output, for whoever reads the log
    assert missing_ops(["FusedAdamBuilder"], tmp_path / "ext") == ["FusedAdamBuilder"]


def test_a_child_that_loads_every_op_is_not_started_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's success path, without a compile: the CPU accelerator has no FusedLamb, so the child
    leaves it to the script (DeepSpeed then says so itself) and reports success; the worker does not
    ask again before its next experiment. (A real build: the failure tests above run torch's.)"""
    monkeypatch.setattr(op_prebuild, "_LOADED_HERE", set())
    log = tmp_path / layout.rank_log(0, "op_prebuild")  # the name workers.slot.rank gives it
    assert prebuild_ops(["FusedLambBuilder"], _env(tmp_path / "ext"), log) is None
    assert log.is_file() and json.loads(log.with_suffix(".json").read_text()) == {}
    written = [p.name for p in tmp_path.iterdir() if p.is_file()]
    assert len(written) == 2 and all(layout.is_experiment_file(name) for name in written)  # overwrite knows them
    log.unlink()
    assert prebuild_ops(["FusedLambBuilder"], _env(tmp_path / "ext"), log) is None and not log.exists()


def test_a_stopped_launch_stops_the_build_and_reports_nothing(tmp_path: Path) -> None:
    started = time.monotonic()
    failure = prebuild_ops(["FusedAdamBuilder"], _env(tmp_path / "ext", CXX=str(failing_compiler(tmp_path))),
                           tmp_path / "b.log", keep_alive=lambda: True)
    assert failure is None and time.monotonic() - started < 10  # the launch's abort is its own answer


def test_a_build_past_its_time_limit_is_a_failure_naming_the_op_and_leaves_no_lock(tmp_path: Path) -> None:
    """Killed mid-build (its whole process group), it must not leave torch's lock: every later build
    of that op on the node would wait on it forever."""
    ext = tmp_path / "ext"
    (ext / "fused_adam").mkdir(parents=True)
    slow = _env(ext, CXX=str(_slow_compiler(tmp_path)))
    # The limit must end the build while it compiles: importing DeepSpeed before the compile starts
    # takes 3-6 s here with the suite running beside it, up to 15 s on a loaded machine, so a limit
    # that ended the build before it compiled is tried again, longer.
    for limit in (8, 20, 60):
        groups: list[int] = []
        failure = prebuild_ops(["FusedAdamBuilder"], slow, tmp_path / "b.log", timeout_s=limit,
                               on_start=groups.append)
        assert failure == f"fused_adam: not built within {limit}s", failure
        if (tmp_path / "compiling").is_file():
            break
    assert (tmp_path / "compiling").is_file()  # it was killed while compiling, holding torch's lock
    assert not (ext / "fused_adam" / "lock").exists()
    assert len(groups) == 1 and not _group_alive(groups[0])


def _slow_compiler(folder: Path) -> Path:
    compiler = folder / "slow-c++"
    compiler.write_text('#!/bin/sh\ncase "$1" in --version|-v) echo "g++ (Debian 12.2.0-14) 12.2.0"; exit 0;; esac\n'
                        f'touch {folder / "compiling"}\nexec sleep 600\n')
    compiler.chmod(0o755)
    return compiler


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
