"""Strict FIFO vs EASY backfill on real Celery slot workers: the same mixed-gang workload, twice.

Unlike bench/backfill.py (a simulation of the policy), this MEASURES: an embedded cluster (a real
redis-server, one real slot worker per slot, a control worker) runs the workload as a fixed job
(dispatched by the control worker), once with `strict_fifo` (DeepSpeed's ResourceManager rule) and once with `backfill`.
Each experiment is tests/integration/scripts/fake_train.py sleeping for its run time, so what is
measured is scheduling: reservations, chords, rendezvous and process start-up included.

Utilisation = busy slot-seconds / (slots x makespan), from each experiment's own start and end
times as its slot workers recorded them. Estimates are the time limit (the same for every
experiment here), which is what dispatch knows before anything has finished.

    .venv/bin/python bench/backfill_real.py [--slots 4] [--seed 3] [--experiments 12]
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import uuid
from pathlib import Path

from scheduler.cluster.backfill import Policy, backfill, strict_fifo
from scheduler.search.space import Experiment, experiment_config
from scheduler.embedded.local_cluster import LocalCluster
from workers.state.connection import connect

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "integration" / "scripts" / "fake_train.py"
TIME_LIMIT_S = 60.0


def workload(seed: int, count: int, slots: int) -> tuple[list[Experiment], str]:
    """Mixed gangs (1 slot, half the slots, all the slots), each with its own sleep; the fake
    script's --behaviour maps each experiment's micro-batch size (its id) to its run time."""
    rng = random.Random(seed)
    experiments, behaviour = [], []
    for index in range(1, count + 1):
        gang = rng.choice([1, 1, max(1, slots // 2), slots])
        run_s = round(rng.uniform(2.0, 8.0), 1)
        config = experiment_config({"autotuning": {"enabled": True}}, 0, index, 1, gang, 1, 1)
        experiments.append(Experiment(f"e{index:02d}_g{gang}", 0, index, 1, config, 1, gang))
        behaviour.append(f"{index}=slow{run_s}")
    return experiments, ",".join(behaviour)


def measure(policy: Policy, experiments: list[Experiment], behaviour: str, slots: int, url: str) -> dict:
    from scheduler.cluster.jobs import JobSpec, run_fixed
    from tasks import app
    from tasks.work import CeleryWork

    results = Path(tempfile.mkdtemp(prefix=f"bench-{policy.__name__}-"))

    def argv(exp: Experiment) -> list[str]:
        return [str(FAKE), "--behaviour", behaviour, "--deepspeed_config", str(results / exp.name / "ds_config.json")]

    spec = JobSpec(job=uuid.uuid4().hex, results_root=str(results), cwd=str(ROOT), timeout_s=TIME_LIMIT_S,
                   experiments=[{**exp.to_json(), "argv": argv(exp)} for exp in experiments],
                   policy=policy.__name__)
    records = run_fixed(connect(url), CeleryWork(app), spec)
    assert all(r["status"] == "ok" for r in records), [r["status"] for r in records]
    start = min(r["started_at"] for r in records)
    end = max(r["ended_at"] for r in records)
    busy = sum((r["ended_at"] - r["started_at"]) * len(r["slots"]) for r in records)
    order = [r["name"] for r in sorted(records, key=lambda r: r["started_at"])]
    return {"makespan": end - start, "utilisation": busy / (slots * (end - start)), "order": order}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--experiments", type=int, default=12)
    args = parser.parse_args()
    experiments, behaviour = workload(args.seed, args.experiments, args.slots)
    print("MEASURED on real Celery slot workers (embedded cluster), same workload for both policies:")
    print("  " + " ".join(e.name for e in experiments))
    with LocalCluster(args.slots, Path(tempfile.mkdtemp(prefix="bench-cluster-"))) as cluster:
        os.environ["AUTOTUNE_REDIS_URL"] = cluster.url
        rows = {policy.__name__: measure(policy, experiments, behaviour, args.slots, cluster.url)
                for policy in (strict_fifo, backfill)}
    print(f"\n{'policy':<26}{'makespan s':>12}{'utilisation':>13}")
    for name, label in (("strict_fifo", "strict FIFO (DeepSpeed)"), ("backfill", "EASY backfill (ours)")):
        print(f"{label:<26}{rows[name]['makespan']:>12.1f}{rows[name]['utilisation']:>12.1%}")
    fifo, ours = rows["strict_fifo"], rows["backfill"]
    print(f"{'backfill / FIFO':<26}{ours['makespan'] / fifo['makespan']:>11.2f}x"
          f"{ours['utilisation'] / fifo['utilisation']:>12.2f}x")
    print("start order, FIFO:    ", " ".join(fifo["order"]))
    print("start order, backfill:", " ".join(ours["order"]))


if __name__ == "__main__":
    main()
