"""Ctrl-C under load: seconds from SIGINT to the command's exit, with a 2-rank experiment running.

Why: a user's Ctrl-C must end the command promptly (every process stopped, the records written)
however busy the machine is; a fresh-clone test run once saw it take over a minute. Each run starts
`python -m scheduler.autotune` on an embedded cluster (2 CPU slots) with a config whose second
experiment hangs (tests/integration/scripts/fake_train.py), waits until both of its ranks run, sends
SIGINT and times the exit while `--load` busy processes take the cores. Then it counts what is left
(processes carrying the run's marker). `--baseline DIR` alternates the runs with another checkout
of this project (e.g. a `git worktree` at an earlier commit), so both are measured side by side.

    .venv/bin/python bench/interrupt.py [--runs 5] [--load 3] [--baseline DIR]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
FAKE_TRAIN = ROOT / "tests" / "integration" / "scripts" / "fake_train.py"
START_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 180.0


def _burn() -> None:
    while True:
        pass


def _left(marker: str) -> int:
    count = 0
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get("AUTOTUNE_TEST_MARKER") == marker:
                count += 1
        except psutil.Error:
            continue
    return count


def one_run(tree: Path, workdir: Path) -> tuple[float, int, int]:
    """(seconds from SIGINT to exit, exit code, processes left 5 s after) for one interrupted job."""
    config = {"train_micro_batch_size_per_gpu": [1, 2], "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0},
              "autotuning": {"enabled": True, "metric": "throughput", "user_script": str(FAKE_TRAIN),
                             "user_args": ["--behaviour", "2=hang"]}}
    (workdir / "cfg.json").write_text(json.dumps(config))
    marker = secrets.token_hex(8)
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    env.update(AUTOTUNE_TEST_MARKER=marker, PYTHONPATH=str(tree))
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.autotune", "cfg.json", "--slots", "2", "--num_gpus", "2"],
                            cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    hung = workdir / "autotuning_results" / "z0_gas1_tmbspg2"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ((hung / "started.rank0").exists() and (hung / "started.rank1").exists()):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"the hanging experiment never started in {workdir}")
        time.sleep(0.1)
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    took = time.monotonic() - sent
    time.sleep(5.0)
    return took, proc.returncode, _left(marker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--load", type=int, default=3, help="busy processes beside the command")
    parser.add_argument("--baseline", type=Path, help="another checkout, alternated with this one")
    args = parser.parse_args()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started as a shell's background job: the
        signal.signal(signal.SIGINT, signal.default_int_handler)  # command gets Ctrl-C as from a terminal
    trees = {"this tree": ROOT, **({f"baseline {args.baseline}": args.baseline.resolve()} if args.baseline else {})}
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.load)]
    for burner in burners:
        burner.start()
    figures: dict[str, list[tuple[float, int, int]]] = {name: [] for name in trees}
    try:
        for run in range(args.runs):
            for name, tree in trees.items():
                with tempfile.TemporaryDirectory(prefix="interrupt-bench-") as workdir:
                    figures[name].append(one_run(tree, Path(workdir)))
                took, code, left = figures[name][-1]
                print(f"run {run + 1} {name}: exit {code} after {took:.1f} s, {left} process(es) left", flush=True)
    finally:
        for burner in burners:
            burner.terminate()
    print(f"\nSIGINT to exit, {args.runs} runs each, {args.load} busy processes on {os.cpu_count()} cores:")
    for name, runs in figures.items():
        seconds = [took for took, _, _ in runs]
        print(f"  {name}: median {statistics.median(seconds):.1f} s, max {max(seconds):.1f} s; "
              f"exit codes {sorted({code for _, code, _ in runs})}; processes left {sum(left for _, _, left in runs)}")


if __name__ == "__main__":
    main()
