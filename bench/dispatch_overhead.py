"""The control path's own cost: the gap on a slot between one experiment's process ending and the
next one's starting, over a 240-experiment tuning job of trivial experiments, next to a bare Celery
chord round trip measured on the same cluster in the same run.

What runs: an embedded cluster (real redis-server, 2 slot workers, a control worker), then
`python -m scheduler.autotune` on a list-mode config of 240 micro-batch sizes (one ZeRO stage, model
info given, so no profile run) whose script (tests/integration/scripts/fake_train.py) only writes
its metrics. Each gap is read from the slot workers' own records: the next launch's start minus the
previous launch's end on the same slot, so it holds the chord callback (record, replay, queue),
dispatch, the chord's delivery and the rank's preparation, and nothing of the script. The bare
round trip is a one-task chord (`celery.accumulate` on a slot queue, body on the control queue),
the floor any chord-based design pays.

    .venv/bin/python bench/dispatch_overhead.py [--experiments 240] [--slots 2] [--round-trips 50]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scheduler.embedded.local_cluster import LocalCluster
from workers.state.connection import connect

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "integration" / "scripts" / "fake_train.py"


def bare_chord_round_trips(url: str, queue: str, count: int) -> list[float]:
    """Seconds from sending a one-task chord to its body's result, `count` times, measured in a
    process of its own that ends while the cluster runs: Celery's result objects unsubscribe from
    Redis when they are collected, which at this interpreter's exit would meet a stopped Redis and
    print a traceback."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_round_trips, (url, queue, count))


def _round_trips(url: str, queue: str, count: int) -> list[float]:
    os.environ["AUTOTUNE_REDIS_URL"] = url
    from celery import chord

    from tasks import app

    times = []
    for _ in range(count):
        started = time.perf_counter()
        result = chord([app.signature("celery.accumulate", args=(1,), queue=queue)],
                       app.signature("celery.accumulate", queue="control")).apply_async()
        result.get(timeout=30)
        times.append(time.perf_counter() - started)
    return times


def gaps_of(results: Path) -> list[tuple[float, float]]:
    """(start of the later launch, gap in seconds) for consecutive launches on each slot."""
    by_slot: dict[str, list[tuple[float, float]]] = {}
    for path in results.glob("*/result.json"):
        record = json.loads(path.read_text())
        for rank in record.get("ranks", []):
            by_slot.setdefault(rank["slot"], []).append((rank["started_at"], rank["ended_at"]))
    gaps = []
    for launches in by_slot.values():
        launches.sort()
        gaps += [(later[0], later[0] - earlier[1]) for earlier, later in zip(launches, launches[1:])]
    return sorted(gaps)


def describe(label: str, values_s: list[float]) -> str:
    ms = sorted(v * 1000 for v in values_s)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return (f"{label:<34} n={len(ms):<4} median {statistics.median(ms):7.1f} ms   p90 {p90:7.1f} ms   "
            f"max {ms[-1]:8.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", type=int, default=240)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--round-trips", type=int, default=50)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-dispatch-"))
    config = {"train_micro_batch_size_per_gpu": list(range(1, args.experiments + 1)),
              "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
              "autotuning": {"enabled": True, "metric": "throughput", "user_script": str(FAKE),
                             "model_info": {"num_params": 1000, "trainable_num_params": 1000,
                                            "activation_mem_per_gpu": 1}}}
    (work / "cfg.json").write_text(json.dumps(config))
    with LocalCluster(args.slots, work / "cluster", slot_memory="1GiB") as cluster:
        client = connect(cluster.url)
        queue = sorted(k.decode().rsplit(":", 1)[-1] for k in client.scan_iter(match="autotune:slot:*"))
        slot_queue = next((q for q in queue if ".gpu" in q), f"{cluster.node}.gpu0")
        round_trips = bare_chord_round_trips(cluster.url, slot_queue, args.round_trips)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "scheduler.autotune", str(work / "cfg.json"),
                               "--num_gpus", "1"], cwd=work, env={**os.environ, "AUTOTUNE_REDIS_URL": cluster.url},
                              capture_output=True, text=True)
        wall = time.perf_counter() - started
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-2000:])
        return 1
    gaps = gaps_of(work / "autotuning_results")
    half = len(gaps) // 2
    print(f"{args.experiments} trivial experiments on {args.slots} slots in {wall:.1f} s (results in {work})")
    print(describe("bare chord round trip", round_trips))
    print(describe("gap between experiments on a slot", [g for _, g in gaps]))
    print(describe("  first half of the job", [g for _, g in gaps[:half]]))
    print(describe("  second half of the job", [g for _, g in gaps[half:]]))
    print(f"median gap / median bare round trip: "
          f"{statistics.median(g for _, g in gaps) / statistics.median(round_trips):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
