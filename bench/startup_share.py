"""How much of each experiment is start-up, not measurement (issue 33).

Runs the README example narrowed to ZeRO 0-1 and micro-batch 2 and 8 (start/end_profile_step 1/1,
as examples/cfg.json sets them) on an embedded cluster, then reads every measured experiment's
result.json and prints, per experiment and as the job's median:

    start-up share   = 1 - (end_profile_step + 1) x step latency / wall
    start-up seconds = wall - (end_profile_step + 1) x step latency

(the issue's definition: the steps the config asks for are training, everything else is not), and,
where the records carry it (`timeline`, workers.slot.timeline), the phases of rank 0: interpreter up,
DeepSpeed imported, engine ready, first step, measured window, exit. The figures come from the
records alone, so the same script reads a results folder written by older code (`--results DIR`).

    .venv/bin/python bench/startup_share.py                  # run the job, then report
    AUTOTUNE_WARM_START=0 .venv/bin/python bench/startup_share.py   # the same, every rank cold (before warm start)
    .venv/bin/python bench/startup_share.py --results DIR    # report on an existing results folder
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("up", "imports", "engine", "first_step", "window_start", "window_end", "ended")


def narrowed_config(folder: Path) -> Path:
    """examples/cfg.json narrowed to ZeRO 0-1 and micro-batch 2 and 8, its results in `folder`."""
    config = json.loads((ROOT / "examples" / "cfg.json").read_text())
    config["train_micro_batch_size_per_gpu"] = [2, 8]
    config["zero_optimization"]["stage"] = [0, 1]
    config["autotuning"].update(user_script=str(ROOT / "examples" / "train_gpt.py"),
                                results_dir=str(folder / "results"), exps_dir=str(folder / "exps"))
    path = folder / "cfg_narrow.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def experiment_figures(record: dict[str, Any], end_profile_step: int) -> dict[str, Any] | None:
    """Wall, step latency, start-up share and seconds of one measured record; None if unmeasured."""
    metrics = record.get("metrics") or {}
    wall, latency_us = record.get("wall_s"), metrics.get("latency")
    if record.get("status") != "ok" or not wall or not latency_us:
        return None
    training = (end_profile_step + 1) * latency_us / 1e6
    figures = {"name": record["name"], "wall_s": wall, "step_s": latency_us / 1e6,
               "startup_share": 1 - training / wall, "startup_s": wall - training}
    rank0 = next((r for r in record.get("ranks", []) if r.get("rank") == 0), {})
    if isinstance(rank0.get("timeline"), dict):
        figures["timeline"] = rank0["timeline"]
        figures["path"] = rank0.get("start_path", "")
    return figures


def report(results: Path, end_profile_step: int) -> dict[str, float]:
    rows = []
    for path in sorted(results.glob("*/result.json")):
        figures = experiment_figures(json.loads(path.read_text()), end_profile_step)
        if figures is not None:
            rows.append(figures)
    if not rows:
        sys.exit(f"error: no measured experiment under {results}")
    print(f"{'experiment':<16} {'wall s':>7} {'step s':>7} {'share':>6} {'start-up s':>10}  path  "
          + " ".join(f"{p:>12}" for p in PHASES))
    for row in rows:
        marks = row.get("timeline", {})
        print(f"{row['name']:<16} {row['wall_s']:7.2f} {row['step_s']:7.3f} {row['startup_share']:6.2f} "
              f"{row['startup_s']:10.2f}  {row.get('path', '') or '-':<5} "
              + " ".join(f"{marks[p]:12.2f}" if p in marks else f"{'-':>12}" for p in PHASES))
    summary = {"startup_share_median": statistics.median(r["startup_share"] for r in rows),
               "startup_s_median": statistics.median(r["startup_s"] for r in rows),
               "wall_s_median": statistics.median(r["wall_s"] for r in rows), "measured": len(rows)}
    print(json.dumps({key: round(value, 3) for key, value in summary.items()}))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="report on this results folder instead of running the job")
    parser.add_argument("--keep", type=Path, help="run in this folder (kept) instead of a temporary one")
    parser.add_argument("--slot-memory", help="memory cap per slot (default: the embedded cluster's, RAM / slots)")
    args = parser.parse_args()
    end_profile_step = json.loads((ROOT / "examples" / "cfg.json").read_text())["autotuning"]["end_profile_step"]
    if args.results:
        report(args.results, end_profile_step)
        return
    with tempfile.TemporaryDirectory(prefix="startup_share.") as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        config = narrowed_config(folder)
        began = time.monotonic()
        memory = ["--slot-memory", args.slot_memory] if args.slot_memory else []
        subprocess.run([sys.executable, "-m", "scheduler.autotune", str(config), *memory],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        print(f"tuning wall: {time.monotonic() - began:.1f} s")
        report(folder / "results", end_profile_step)


if __name__ == "__main__":
    main()
