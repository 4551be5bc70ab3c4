"""What the user sees while and after tuning: the live panel in a (pseudo-)terminal, plain lines and
an honest ending in a log when the search is interrupted, and pasteable commands at any width."""
from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
import csv
import fcntl
from pathlib import Path

import pytest

from integration_helpers import wait_for, write_config
from tests.unit.test_outputs import assert_drawn_png

pytestmark = pytest.mark.integration
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    env.update(TERM="xterm-256color", COLUMNS="", LINES="")
    return {key: value for key, value in env.items() if value}


def test_live_panel_in_a_terminal(tmp_path):
    """The command in an 80-column pseudo-terminal: the panel is drawn and redrawn while experiments
    run, and the `run it:` command, longer than the terminal is wide, is printed on one line."""
    deep = tmp_path / ("a-long-folder-name-so-the-command-is-wider-than-the-terminal" * 2)
    deep.mkdir()
    cfg = write_config(deep / "cfg.json", train_micro_batch_size_per_gpu=[1, 2, 3])
    data = json.loads(cfg.read_text())
    data["autotuning"]["user_args"] = ["--behaviour", "1=slow3,2=slow3,3=slow3"]
    cfg.write_text(json.dumps(data))
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.autotune", str(cfg), "--slots", "2", "--num_gpus", "1"],
                            cwd=deep, env=_env(), stdin=follower, stdout=follower, stderr=follower,
                            start_new_session=True)
    os.close(follower)
    output = b""
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the terminal closed: the command ended
                    break
                if not chunk:
                    break
                output += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=30) == 0, output.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
        os.close(leader)
    text = output.decode(errors="replace")
    plain = ANSI.sub("", text).replace("\r", "")
    assert "slots busy" in plain and "best so far" in plain and "elapsed" in plain
    assert re.search(r"slots busy [12]/2", plain)  # drawn while an experiment held a slot
    assert re.search(r"this phase ~\d+:\d\d:\d\d left", plain)  # an estimate once a result came in
    assert text.count("\x1b[2K") >= 3  # redrawn in place, not printed once
    results = deep / "autotuning_results"
    command = (results / "cmd_optimal.txt").read_text().strip()
    assert len(command) > 80
    assert f"run it: {command}" in plain.splitlines()
    assert_drawn_png(results / "timeline.png")
    jsonl = [json.loads(line) for line in (results / "results.jsonl").read_text().splitlines()]
    rows = list(csv.DictReader((results / "results.csv").open()))
    assert rows and [(r["name"], r["status"]) for r in rows] == [(r["name"], r["status"]) for r in jsonl]


def test_interrupted_run_says_so_in_a_log(tmp_path):
    """Ctrl-C with one experiment measured and one running: "interrupted", what was measured, a
    `cancelled` line for the running one, and no ds_config_optimal.json. Not a terminal: no panel."""
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2])
    data = json.loads(cfg.read_text())
    data["autotuning"]["user_args"] = ["--behaviour", "2=hang"]
    cfg.write_text(json.dumps(data))
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.autotune", str(cfg), "--slots", "2", "--num_gpus", "2"],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = tmp_path / "autotuning_results"
    hung = results / "z0_gas1_tmbspg2"
    try:
        try:
            wait_for(lambda: (hung / "started.rank0").exists() and (hung / "started.rank1").exists(), 120,
                     "the hanging experiment to start")
        except AssertionError:
            proc.send_signal(signal.SIGINT)
            raise AssertionError("the hanging experiment never started: " + "".join(proc.communicate(timeout=90)))
        time.sleep(1.5)  # the panel would have refreshed by now, were it drawn
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert "\x1b[" not in out and "slots busy" not in out  # plain lines only
    assert "interrupted: measured 1 experiment(s) (z0_gas2_tmbspg1); cancelled 1" in out
    assert "no experiment succeeded" not in out and "Tuning completed" not in out
    assert "best so far (partial search, not an optimum): z0_gas2_tmbspg1" in out
    lines = {line["name"]: line for line in map(json.loads, (results / "results.jsonl").read_text().splitlines())}
    assert lines["z0_gas2_tmbspg1"]["status"] == "ok"
    assert lines["z0_gas1_tmbspg2"]["status"] == "cancelled" and len(lines["z0_gas1_tmbspg2"]["slots"]) == 2
    assert not (results / "ds_config_optimal.json").exists() and not (results / "cmd_optimal.txt").exists()
    assert json.loads((results / "ds_config_best_partial.json").read_text())["train_micro_batch_size_per_gpu"] == 1
    assert "Tuning interrupted" in (results / "summary.txt").read_text()
