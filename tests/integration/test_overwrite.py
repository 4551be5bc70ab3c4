"""`"overwrite": true` on a folder a real run filled: the embedded cluster, real
Celery workers and real rank processes (tests/integration/scripts/fake_train.py, which with
--quiet-folder writes nothing into its experiment folder but the metrics, as a real script) leave
a finished or an interrupted run behind; the next run with overwrite starts afresh, and a file the
user put there is still refused and kept. Every file the run wrote must be one `workers.files.layout`
lists, or the second run would be refused (it was: results.csv, timeline.png, *_best_partial*).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integration_helpers import run_autotune, stop_group, wait_for, write_config
from workers.files import layout

pytestmark = pytest.mark.integration
ARGS = ["--slots", "2", "--num_gpus", "1", "--slot-memory", "1GiB", "--exp-timeout", "120"]
MBS1, MBS2 = "z0_gas2_tmbspg1", "z0_gas1_tmbspg2"  #: sizes [1, 2]: 2 samples per step (DeepSpeed's rule)
ALONE = "z0_gas1_tmbspg1"  #: size [1] alone
#: the winner read again (scheduler.search.repeats.confirm): a folder and a record of its own
MBS2_R2, ALONE_R2 = f"{MBS2}_r2", f"{ALONE}_r2"
MODEL_INFO = {"num_params": 1000, "trainable_num_params": 1000, "activation_mem_per_gpu": 2**20}


def _config(tmp_path: Path, sizes: list[int], behaviour: str = "") -> Path:
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=sizes)
    data = json.loads(cfg.read_text())
    data["autotuning"].update(overwrite=True, model_info=MODEL_INFO,
                              user_args=["--quiet-folder", *(["--behaviour", behaviour] if behaviour else [])])
    cfg.write_text(json.dumps(data))
    return cfg


def _files(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_interrupted_then_a_finished_run_are_overwritten_and_a_users_file_is_refused_and_kept(
        tmp_path: Path) -> None:
    """One folder, four runs with `"overwrite": true`: Ctrl-C with micro-batch 1 measured and 2
    hanging (the partial best, cancelled lines, a killed experiment's files are left); a run that
    empties that and finishes; a run of micro-batch 1 alone that empties the finished run and
    measures afresh; then a file of the user's: refused in one line, nothing deleted."""
    results = tmp_path / "autotuning_results"
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.autotune", str(_config(tmp_path, [1, 2], "2=hang")),
                             *ARGS], cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        wait_for(lambda: (results / MBS1 / layout.RESULT).is_file() and (results / MBS2 / "stdout.log").is_file(),
                 180, "micro-batch 1 measured and micro-batch 2 running")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        stop_group(proc)
    assert proc.returncode == 130, out + err
    left = set(_files(results))
    assert {layout.PARTIAL_FILES[0], layout.RESULTS_CSV} <= left and layout.TIMELINE_PLOT not in left
    assert not left & set(layout.OPTIMAL_FILES) and _statuses(results) == {MBS1: "ok", MBS2: "cancelled"}
    interrupted = time.time()

    finished = run_autotune([str(_config(tmp_path, [1, 2])), *ARGS], tmp_path, _env(tmp_path))
    assert finished.returncode == 0, finished.stdout + finished.stderr
    names = set(_files(results))
    assert not names & set(layout.PARTIAL_FILES) and {layout.RESULTS_CSV, *layout.OPTIMAL_FILES[:2]} <= names
    # no cancelled line kept from the interrupted run; fake_train's best, micro-batch 2, confirmed
    assert _statuses(results) == {MBS1: "ok", MBS2: "ok", MBS2_R2: "ok"}
    assert json.loads((results / MBS1 / layout.RESULT).read_text())["started_at"] > interrupted  # not resumed
    measured = time.time()

    afresh = run_autotune([str(_config(tmp_path, [1])), *ARGS], tmp_path, _env(tmp_path))
    assert afresh.returncode == 0, afresh.stdout + afresh.stderr
    assert _statuses(results) == {ALONE: "ok", ALONE_R2: "ok"}
    assert not any((results / name).exists() for name in (MBS1, MBS2, MBS2_R2))  # the finished run's went with it
    assert sorted(p.name for p in (tmp_path / "autotuning_exps").glob("*.json")) == [f"{ALONE}.json", f"{ALONE_R2}.json"]
    assert all(json.loads((results / name / layout.RESULT).read_text())["started_at"] > measured
               for name in (ALONE, ALONE_R2))

    (results / "notes.txt").write_text("mine")
    (results / ALONE / "checkpoint.pt").write_text("weights")
    before = _files(results)
    refused = run_autotune([str(_config(tmp_path, [1])), *ARGS], tmp_path, _env(tmp_path), timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("error: ") and "was not written by celery-autotune" in line
    assert "checkpoint.pt" in line or "notes.txt" in line
    assert _files(results) == before  # nothing deleted, nothing rewritten
    assert (results / "notes.txt").read_text() == "mine"


def _statuses(results: Path) -> dict[str, str]:
    lines = (results / layout.RESULTS_JSONL).read_text().splitlines()
    return {record["name"]: record["status"] for record in map(json.loads, lines)}


def _env(tmp_path: Path) -> dict[str, str]:
    """The user's environment without a cluster URL (an embedded cluster), with a folder of compiled
    ops of its own: fake_train needs none, and a stale op in a shared one would be rebuilt first."""
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")
    return env
