"""What tests/conftest.py promises every test: the environment a test changed is put back before the
next one runs (a leaked MLFLOW_TRACKING_URI sent later tests' jobs to MLflow)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TWO_TESTS = '''
import os

def test_one_changes_the_environment():
    os.environ["AUTOTUNE_LEAKED"] = "1"
    os.environ.pop("AUTOTUNE_KEPT")

def test_the_next_finds_it_as_it_was():
    assert "AUTOTUNE_LEAKED" not in os.environ and os.environ["AUTOTUNE_KEPT"] == "1"
'''


def test_a_test_that_changes_the_environment_does_not_hand_it_to_the_next(tmp_path: Path) -> None:
    tests = tmp_path / "test_two.py"
    tests.write_text(TWO_TESTS)
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_TEST_RUN"}
    env.update(AUTOTUNE_KEPT="1", PYTHONPATH=str(ROOT / "tests"))  # tests/conftest.py, as the plugin `conftest`
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "conftest",
                          "--rootdir", str(tmp_path), str(tests)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout + run.stderr
