"""Bad input ends in one line naming the problem and the fix, exit status 2, and no traceback."""
from __future__ import annotations

import os
import sys

import pytest

from integration_helpers import run_autotune, write_config


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
