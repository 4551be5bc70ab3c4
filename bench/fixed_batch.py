"""Fixed global batch: the sampled search when the user's config gives `train_batch_size` as a number
(issue 32 item 1), replayed over bench/surfaces.py's synthetic GPU-like scripts with no cluster.

Each surface gets a global batch a user would fix: world x S samples per step, S drawn per surface
(from its seed) as a "round" number (2^k or 3 x 2^k) between a quarter and 8 times the largest
micro-batch ZeRO-1 holds, so some batches need accumulation and some fit in one micro-step at a
stage that holds more. The surface's max_train_batch_size is dropped (the kept batch sets the step).
The best config that keeps the batch is the best noise-free throughput over every stage and every
micro-batch m dividing S that fits, with gas = S / m. Per family: the median and 10th percentile of
the fraction of that optimum the named config reaches, the share of searches whose every experiment
kept the batch (must be 100 %), the median and 90th percentile of launches (profile and repeats
included) and of failed probes, and the share of surfaces where DeepSpeed 0.19's replay (which
overwrites the batch) named a config that keeps it.

`--misses` lists every search whose pick fell below GOOD of the best config keeping the batch: the
pick and the best, then each launch with its config's noise-free fraction and what it read.

    .venv/bin/python bench/fixed_batch.py [--surfaces 60] [--seed 0] [--family mid-peak] [--misses]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.deepspeed_replay import DeepSpeedFastMode  # noqa: E402
from bench.stats import quantile  # noqa: E402
from bench.surfaces import FAMILIES, Surface, make_surface, user_config  # noqa: E402
from scheduler.search.fast_search import PROFILE, SearchSettings, fast_search  # noqa: E402
from scheduler.search.global_batch import GlobalBatch, kept_sizes  # noqa: E402
from scheduler.search.phases import Phase, drive  # noqa: E402
from scheduler.search.ranking import best  # noqa: E402


#: A pick at this fraction of the best config keeping the batch or above meets issue 32's goal.
GOOD = 0.97


def kept_batch(surface: Surface, seed: int) -> int:
    """The global batch a user fixed for this surface (module docstring), a multiple of its world."""
    rng = random.Random(f"fixed-batch-{seed}-{surface.family}")
    top = max(1, surface.max_fit(1) or surface.max_fit(3))
    target = top * 2 ** rng.uniform(-2, 3)
    rounds = sorted({b * 2 ** k for b in (1, 3) for k in range(0, 16)})
    share = min(rounds, key=lambda value: abs(value / target - 1))
    return share * surface.world


def kept_optimum(surface: Surface, share: int) -> float:
    """The best noise-free throughput among the configs keeping S = `share` per GPU (0: none fits)."""
    return max((surface.throughput(stage, m, share // m) for stage in range(4) for m in kept_sizes(share, 1, share)
                if surface.fits(stage, m)), default=0.0)


def ours(surface: Surface, batch: int) -> dict[str, Any]:
    config = {**user_config(surface), "train_batch_size": batch}
    config["autotuning"] = {k: v for k, v in config["autotuning"].items() if k != "max_train_batch_size"}
    settings = SearchSettings(ds_config=config, capacity_bytes=surface.capacity, stages=(0, 1, 2, 3),
                              num_gpus=surface.world, peak_memory_key="peak_device_bytes", host_memory=False,
                              global_batch=GlobalBatch(batch, f"train_batch_size {batch}"))
    launches: list[dict[str, Any]] = []

    def run_phase(phase: Phase) -> dict[str, dict[str, Any]]:
        out = {}
        for exp in phase.experiments:
            record = surface.run(exp.name, exp.ds_config, profile=exp.name == PROFILE)
            launches.append(record)
            out[exp.name] = record
        return out

    try:
        drive(fast_search(settings), run_phase)
    except Exception as exc:  # a refusal (nothing keeps the batch) is an outcome: named nothing
        refused = f"{type(exc).__name__}: {exc}"
    else:
        refused = ""
    tuned = [r for r in launches if r.get("name") != PROFILE]
    winner = best(tuned, "throughput", True)
    config = winner["ds_config"] if winner else None
    value = surface.throughput(int(config["zero_optimization"]["stage"]), config["train_micro_batch_size_per_gpu"],
                               config["gradient_accumulation_steps"], config["zero_optimization"]) if config else 0.0
    return {"value": value, "launches": len(launches), "failed": sum(r.get("status") != "ok" for r in launches),
            "kept": all(r["ds_config"]["train_batch_size"] == batch for r in tuned), "refused": refused,
            "tuned": tuned, "winner": winner}


def _point(config: dict[str, Any]) -> tuple[int, int, int]:
    return int(config["zero_optimization"]["stage"]), config["train_micro_batch_size_per_gpu"], \
        config["gradient_accumulation_steps"]


def print_miss(surface: Surface, share: int, optimum: float, outcome: dict[str, Any]) -> None:
    """One search below GOOD: what it named, the best config keeping the batch, and every launch."""
    best_value, stage, mbs = max((surface.throughput(z, m, share // m), z, m) for z in range(4)
                                 for m in kept_sizes(share, 1, share) if surface.fits(z, m))
    picked = _point(outcome["winner"]["ds_config"]) if outcome["winner"] else None
    print(f"  {surface.family} seed {surface.seed}: {outcome['fraction']:.3f}, named {picked}, best (z{stage}, "
          f"mbs {mbs}) at {best_value / optimum:.3f}; share {share}, largest fitting size per stage "
          f"{[surface.max_fit(z) for z in range(4)]}")
    for record in outcome["tuned"]:
        true = surface.throughput(*_point(record["ds_config"])) / optimum
        read = (record.get("metrics") or {}).get("throughput")
        print(f"    {record['name']:<24}{record['status']:<7}true {true:.3f}"
              + (f"  read {read / optimum:.3f}" if read else ""))


def deepspeed_keeps(surface: Surface, batch: int) -> bool:
    """Whether DeepSpeed 0.19's replay, given the same config, names a config with that global batch."""
    config = {**user_config(surface), "train_batch_size": batch}
    result = DeepSpeedFastMode(config, lambda name, cfg, profile: surface.run(name, cfg, profile=profile),
                               capacity=surface.capacity, world=surface.world).tune()
    return bool(result.best_config) and result.best_config.get("train_batch_size") == batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--surfaces", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=FAMILIES, action="append")
    parser.add_argument("--misses", action="store_true", help=f"list the searches below {GOOD} and their launches")
    args = parser.parse_args()
    print(f"FIXED GLOBAL BATCH REPLAY: {args.surfaces} surfaces per family (seeds {args.seed}.."
          f"{args.seed + args.surfaces - 1}), train_batch_size set, fast mode, stage all, 2 ranks")
    print(f"{'family':<13}{'frac med':>9}{'frac p10':>9}{'>=0.97':>8}{'kept':>7}{'launch med':>11}{'launch p90':>11}"
          f"{'failed med':>11}{'failed p90':>11}{'refused':>8}{'DS keeps':>9}")
    everything: list[dict[str, Any]] = []
    misses: list[tuple[Surface, int, float, dict[str, Any]]] = []
    for family in args.family or FAMILIES:
        rows = []
        for seed in range(args.seed, args.seed + args.surfaces):
            surface = replace(make_surface(family, seed), max_train_batch_size=None)
            batch = kept_batch(surface, seed)
            optimum = kept_optimum(surface, batch // surface.world)
            if not optimum:
                continue  # no config keeps it: the refusal is tested in tests/unit/test_global_batch.py
            outcome = ours(surface, batch)
            outcome["fraction"] = outcome["value"] / optimum
            outcome["ds_keeps"] = deepspeed_keeps(surface, batch)
            rows.append(outcome)
            if args.misses and outcome["fraction"] < GOOD:
                misses.append((surface, batch // surface.world, optimum, outcome))
        everything.extend(rows)
        _row(family, rows)
    _row("all", everything)
    if misses:
        print(f"below {GOOD} of the best config keeping the batch (launch: status, its config's fraction, the reading's):")
    for miss in misses:
        print_miss(*miss)


def _row(label: str, rows: list[dict[str, Any]]) -> None:
    fractions = [r["fraction"] for r in rows]
    launches = [r["launches"] for r in rows]
    failed = [r["failed"] for r in rows]
    print(f"{label:<13}{statistics.median(fractions):>9.3f}{quantile(fractions, 0.1):>9.3f}"
          f"{sum(f >= GOOD for f in fractions) / len(rows):>8.0%}{sum(r['kept'] for r in rows) / len(rows):>7.0%}"
          f"{statistics.median(launches):>11.1f}{quantile(launches, 0.9):>11.0f}"
          f"{statistics.median(failed):>11.1f}{quantile(failed, 0.9):>11.0f}"
          f"{sum(bool(r['refused']) for r in rows):>8}{sum(r['ds_keeps'] for r in rows) / len(rows):>9.0%}")


if __name__ == "__main__":
    main()
