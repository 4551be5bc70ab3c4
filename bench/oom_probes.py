"""OOM probes of the fast search: our calibrated memory model vs DeepSpeed's estimate, side by side.

Replays `scheduler.search.fast_search` twice over the SAME memory behaviour: a law fitted to the peaks that
a real tuning run measured (one least-squares line per ZeRO stage over its successful experiments;
a stage without one borrows the nearest stage's line; an experiment whose line exceeds the slot
capacity is an OOM). One replay predicts with the calibrated model (ours), one with DeepSpeed's
estimate (`estimator="deepspeed"`). Throughput for the search's plateau decisions comes from the
run's nearest measured experiment of the stage. It is a replay against a fitted law, not a second
real run: it isolates what the estimate changes.

    .venv/bin/python bench/oom_probes.py autotuning_results --config cfg.json [--capacity BYTES]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from scheduler.errors import OneLineArgumentParser, UsageError, one_line
from scheduler.inputs.config import load_config
from scheduler.search.fast_search import PROFILE, SearchSettings, fast_search
from scheduler.search.phases import drive


def fitted_law(records: list[dict]) -> dict[int, tuple[float, float]]:
    """stage -> (intercept, slope) of peak RSS over micro-batch size, from successful experiments."""
    lines = {}
    for stage in range(4):
        points = [(r["ds_config"]["train_micro_batch_size_per_gpu"], r["peak_rss_bytes"]) for r in records
                  if r["status"] == "ok" and r["name"] != PROFILE
                  and r["ds_config"]["zero_optimization"]["stage"] == stage]
        if len(points) >= 2:
            n = len(points)
            mean_x = sum(x for x, _ in points) / n
            mean_y = sum(y for _, y in points) / n
            slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
            lines[stage] = (mean_y - slope * mean_x, slope)
    return {stage: lines.get(stage) or lines[min(lines, key=lambda s: abs(s - stage))] for stage in range(4)}


def replay(settings: SearchSettings, records: list[dict], law: dict[int, tuple[float, float]]) -> tuple[int, int]:
    """(experiments run, OOM probes) of one fast search against the law."""
    profile = next(r for r in records if r["name"] == PROFILE)
    ran = []

    def run_phase(phase):
        out = {}
        for exp in phase.experiments:
            if exp.name == PROFILE:
                out[exp.name] = profile
                continue
            intercept, slope = law[exp.stage]
            peak = intercept + slope * exp.micro_batch_size
            if peak > settings.capacity_bytes:
                out[exp.name] = {"name": exp.name, "status": "oom", "ds_config": exp.ds_config}
            else:
                nearest = min((r for r in records if r["status"] == "ok" and r["name"] != PROFILE
                               and r["ds_config"]["zero_optimization"]["stage"] == exp.stage),
                              key=lambda r: abs(r["ds_config"]["train_micro_batch_size_per_gpu"]
                                                - exp.micro_batch_size), default=None)
                throughput = (nearest or {"metrics": {"throughput": 1.0}})["metrics"]["throughput"]
                out[exp.name] = {"name": exp.name, "status": "ok", "peak_rss_bytes": int(peak),
                                 "ds_config": exp.ds_config, "metrics": {"throughput": throughput}}
            ran.append(out[exp.name])
        return out

    drive(fast_search(settings), run_phase)
    return len(ran), sum(r["status"] == "oom" for r in ran)


def main() -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--config", type=Path, required=True, help="the config the run tuned")
    parser.add_argument("--capacity", type=int, help="slot memory in bytes (default: the run's slot cap)")
    try:
        args = parser.parse_args()
    except UsageError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    results = args.results_dir / "results.jsonl"
    if not results.is_file():
        print(f"error: {results}: no such file; give the results folder of a tuning run", file=sys.stderr)
        return 2
    records = [json.loads(line) for line in results.read_text().splitlines()]
    capacity = args.capacity or next(
        (r["memory_cap_bytes"] for d in args.results_dir.glob("*/result.json")
         for r in json.loads(d.read_text()).get("ranks", []) if r.get("memory_cap_bytes")), None)
    if not capacity:
        print(f"error: {args.results_dir}: no record names its slot's memory cap; give --capacity BYTES", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config)
    except UsageError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    law = fitted_law(records)
    measured_ooms = sum(r["status"] == "oom" for r in records)
    print(f"REPLAY against a memory law fitted to {args.results_dir} (capacity {capacity / 2**30:.2f} GiB); "
          f"the real run had {len(records) - 1} experiments, {measured_ooms} OOM")
    print(f"{'estimate':<28}{'experiments':>12}{'OOM probes':>12}")
    rows = {}
    for estimator, label in (("calibrated", "calibrated model (ours)"), ("deepspeed", "DeepSpeed's estimate")):
        settings = SearchSettings.from_config(cfg, capacity_bytes=capacity, num_nodes=1, num_gpus=1,
                                              device_kind="cpu", estimator=estimator, concurrency=2)
        rows[estimator] = replay(settings, records, law)
        print(f"{label:<28}{rows[estimator][0]:>12}{rows[estimator][1]:>12}")
    print(f"OOM probes avoided by calibration: {rows['deepspeed'][1] - rows['calibrated'][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
