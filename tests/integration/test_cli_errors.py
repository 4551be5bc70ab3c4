"""Bad input ends in one line naming the problem and the fix, exit status 2, and no traceback."""
from __future__ import annotations

import json
import os
import secrets
import sys

import pytest

from integration_helpers import processes_with_marker, run_autotune, write_config


def _assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_config(tmp_path):
    _assert_one_line_error(run_autotune(["nope.json"], tmp_path), "nope.json", "no such file")


def test_config_is_a_directory(tmp_path):
    (tmp_path / "cfgdir").mkdir()
    _assert_one_line_error(run_autotune(["cfgdir"], tmp_path), "cfgdir", "cannot read")


def test_invalid_json_says_where(tmp_path):
    (tmp_path / "cfg.json").write_text('{\n  "autotuning": {"enabled": true,,}\n}')
    _assert_one_line_error(run_autotune(["cfg.json"], tmp_path), "cfg.json:2:", "invalid JSON/hjson")


def test_hjson_is_accepted(tmp_path):
    (tmp_path / "cfg.hjson").write_text("{\n  # comment\n  autotuning: {\n    enabled: true\n    user_script: missing.py\n  }\n}")
    _assert_one_line_error(run_autotune(["cfg.hjson"], tmp_path), "missing.py", "not found")


def test_no_autotuning_section(tmp_path):
    (tmp_path / "cfg.json").write_text('{"train_micro_batch_size_per_gpu": 4}')
    _assert_one_line_error(run_autotune(["cfg.json"], tmp_path), '"autotuning"', "add")


def test_unknown_autotuning_key_suggests(tmp_path):
    (tmp_path / "cfg.json").write_text('{"autotuning": {"metrc": "latency"}}')
    _assert_one_line_error(run_autotune(["cfg.json"], tmp_path), '"metrc"', 'did you mean "metric"')


def test_script_not_found(tmp_path):
    cfg = write_config(tmp_path / "cfg.json")
    _assert_one_line_error(run_autotune([str(cfg), "--", "absent_train.py"], tmp_path),
                           "absent_train.py", "not found")


def test_no_script_named(tmp_path):
    (tmp_path / "cfg.json").write_text('{"autotuning": {"enabled": true}}')
    _assert_one_line_error(run_autotune(["cfg.json"], tmp_path), "no training script")


def test_bad_slot_memory(tmp_path):
    cfg = write_config(tmp_path / "cfg.json")
    _assert_one_line_error(run_autotune([str(cfg), "--slot-memory", "lots"], tmp_path), "--slot-memory")


def test_no_redis_server_on_path(tmp_path):
    cfg = write_config(tmp_path / "cfg.json")
    bin_dir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bin_dir, "redis-server")):
        pytest.skip("a redis-server lives next to the Python interpreter")
    proc = run_autotune([str(cfg)], tmp_path, {"PATH": bin_dir})
    _assert_one_line_error(proc, "redis-server not found", "apt-get install")


def test_unreachable_redis(tmp_path):
    cfg = write_config(tmp_path / "cfg.json")
    proc = run_autotune([str(cfg)], tmp_path, {"AUTOTUNE_REDIS_URL": "redis://127.0.0.1:1/0"})
    _assert_one_line_error(proc, "cannot reach Redis at 127.0.0.1:1")


# Each of these is decided by the inputs alone, so it is refused before the results folder is marked
# and the embedded cluster (redis-server, Celery workers) starts. Run as a user runs it, the command must leave
# no folder (the embedded cluster's logs would live in results/cluster) and no process carrying the
# run's marker.
REFUSED_UP_FRONT = {
    "search-unknown": ({"search": "grid"}, [], {}, "autotuning.search"),
    "mp-size-not-dividing": ({"mp_size": 3}, ["--slots", "2"], {}, "must divide"),
    "min-above-max-micro-batch": ({"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 4},
                                  [], {}, "make min <= max"),
    "min-slot-memory-above-every-slot": ({}, ["--slots", "1", "--slot-memory", "1GiB", "--min-slot-memory", "2GiB"],
                                         {}, "no slot has that much"),
    "num-gpus-above-embedded-slots": ({}, ["--slots", "1", "--num_gpus", "2"], {}, "--num_gpus 1 or fewer"),
    "model-info-fits-no-stage": ({"model_info": {"num_params": 10**10, "activation_mem_per_gpu": 1024}},
                                 ["--slots", "1", "--slot-memory", "1GiB"], {}, "no allowed ZeRO stage fits"),
    "no-redis-server": ({}, [], {"PATH": "EMPTY"}, "redis-server not found"),
}


@pytest.mark.parametrize("name", sorted(REFUSED_UP_FRONT))
def test_refused_before_any_folder_or_process(tmp_path, name):
    autotuning, flags, env, needle = REFUSED_UP_FRONT[name]
    results, exps = tmp_path / "results", tmp_path / "exps"
    cfg = write_config(tmp_path / "cfg.json")
    data = json.loads(cfg.read_text())
    data["autotuning"].update(autotuning, results_dir=str(results), exps_dir=str(exps))
    cfg.write_text(json.dumps(data))
    marker = secrets.token_hex(8)
    (tmp_path / "empty").mkdir()
    env = {**{k: str(tmp_path / "empty") if v == "EMPTY" else v for k, v in env.items()},
           "AUTOTUNE_DEVICE_KIND": "cpu", "AUTOTUNE_TEST_MARKER": marker}
    proc = run_autotune([str(cfg), *flags], tmp_path, env)
    _assert_one_line_error(proc, needle)
    assert not results.exists() and not exps.exists(), sorted(p.name for p in tmp_path.iterdir())
    assert processes_with_marker(marker) == []
