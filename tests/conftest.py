"""What every test process shares: a run token that dies with the run, and DeepSpeed ops of its own.

Why: the suite runs in several processes at once (pytest-xdist), and tests start real servers,
workers and training ranks, many of them in sessions of their own, so a signal to pytest reaches
none of them.
- **Nothing outlives the run.** The first pytest process (xdist's controller, or the only one) puts a
  token in the environment that every process a test starts inherits (`AUTOTUNE_TEST_RUN`), and
  starts `tests/run_watchdog.py` beside it: when that pytest process ends, however it ends (SIGKILL
  from a time limit included), the watchdog kills every process still carrying the token.
- **No shared build locks.** DeepSpeed's ops load under torch's build lock in `TORCH_EXTENSIONS_DIR`;
  tests in different processes sharing the venv's folder met each other's locks (and a test that
  kills ranks mid-load leaves one). Each test process gets its own copy of the prebuilt folder
  (`deploy/setup.sh` builds it once), so nothing compiles twice and no lock is shared.
- **Ctrl-C reaches the commands the tests interrupt.** A shell starts a background job (`bash .ci/run &`)
  with SIGINT ignored, every process it starts inherits that, and a Python started with SIGINT
  ignored never raises KeyboardInterrupt: each test that sends SIGINT then waited out its limit. Every
  pytest process takes Python's own handler back, so what the tests start takes Ctrl-C as from a
  terminal.
- **No test hands its environment to the next.** Every command a test starts inherits this
  process's environment, so a test that changed it (MLflow's `set_tracking_uri` writes
  MLFLOW_TRACKING_URI) made every later command in the same process log its job to MLflow, in a
  SQLite file created wherever it ran. The environment is put back after each test.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

RUN_TOKEN = "AUTOTUNE_TEST_RUN"
WATCHDOG = Path(__file__).with_name("run_watchdog.py")


def pytest_configure(config) -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not hasattr(config, "workerinput"):  # xdist's controller, or a run in one process
        _start_watchdog(config)
    _own_extensions_dir(config)


def _start_watchdog(config) -> None:
    if RUN_TOKEN in os.environ:  # a pytest run started by a test: the outer run's watchdog covers it
        return
    token = secrets.token_hex(8)
    os.environ[RUN_TOKEN] = token
    env = {key: value for key, value in os.environ.items() if key != RUN_TOKEN}
    config._autotune_watchdog = subprocess.Popen(
        [sys.executable, str(WATCHDOG), str(os.getpid()), token], env=env, start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _own_extensions_dir(config) -> None:
    """This process's TORCH_EXTENSIONS_DIR: a copy of the prebuilt one (lock files left out). A folder
    the user chose stands, as it does for the tool."""
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        return
    from workers.slot.build_locks import default_extensions_dir

    own = Path(tempfile.mkdtemp(prefix="autotune-test-ext-"))
    prebuilt = Path(default_extensions_dir())
    if prebuilt.is_dir():
        shutil.copytree(prebuilt, own, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
    os.environ["TORCH_EXTENSIONS_DIR"] = str(own)
    config._autotune_extensions = own


def pytest_unconfigure(config) -> None:
    own = getattr(config, "_autotune_extensions", None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)


PYTEST_OWN = "PYTEST_CURRENT_TEST"  #: pytest's own, changed at every phase of every test


@pytest.fixture(autouse=True)
def _environment_put_back():
    saved = {key: value for key, value in os.environ.items() if key != PYTEST_OWN}
    yield
    now = {key: value for key, value in os.environ.items() if key != PYTEST_OWN}
    if now != saved:
        for key in now.keys() - saved.keys():
            del os.environ[key]
        os.environ.update(saved)
