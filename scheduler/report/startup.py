"""How much of a job's experiments was start-up rather than measurement: the summary's line.

Why: a launch is what a user pays for, and most of it can be start-up rather than measurement. Every
rank's record carries its phases (`workers.slot.timeline`); this reads the job's records and gives the
median share of an experiment's wall that the steps its config asks for do not explain
(`workers.slot.timeline.startup_share`), the median seconds from launch to engine ready (the slowest rank
of each experiment: the gang trains only when all are ready) and how many launches ran warm
(`workers.warm.warm_start`). Pure: no I/O, tested directly.
"""
from __future__ import annotations

import statistics
from typing import Any, Mapping

from workers.in_rank.metrics import AutotuningSettings
from workers.slot.records import ExperimentRecord
from workers.slot.timeline import startup_seconds, startup_share


def startup_summary(records: list[ExperimentRecord]) -> dict[str, Any] | None:
    """Medians over the measured experiments (status ok, with a latency); None when there is none."""
    shares, seconds, paths = [], [], {"warm": 0, "cold": 0}
    for record in records:
        if not record.ok or not isinstance(record.metrics, dict):
            continue
        settings = AutotuningSettings.from_ds_config(record.ds_config or {})
        share = startup_share(record.wall_s, record.metrics.get("latency"), settings.end_profile_step)
        if share is None:
            continue
        shares.append(share)
        ranks = [r for r in record.ranks if isinstance(r, Mapping)]  # each rank's JSON: its phases are its own
        ready = [startup_seconds(r["timeline"]) for r in ranks if isinstance(r.get("timeline"), Mapping)]
        if ready and None not in ready:
            seconds.append(max(ready))
        for rank in ranks:
            if rank.get("start_path") in paths:
                paths[rank["start_path"]] += 1
    if not shares:
        return None
    return {"measured": len(shares), "startup_share": statistics.median(shares),
            "startup_s": statistics.median(seconds) if seconds else None, "ranks_warm": paths["warm"],
            "ranks_cold": paths["cold"]}


def startup_text(records: list[ExperimentRecord]) -> str:
    """The summary's line about start-up ('' when nothing was measured)."""
    summary = startup_summary(records)
    if summary is None:
        return ""
    text = (f"Start-up: {summary['startup_share']:.2f} of an experiment's wall was not the profiled steps "
            f"(median of {summary['measured']}: 1 - (end_profile_step + 1) x step latency / wall)")
    if summary["startup_s"] is not None:
        text += f"; {summary['startup_s']:.1f} s from launch to engine ready (median, slowest rank)"
    if summary["ranks_warm"] or summary["ranks_cold"]:
        text += f"; ranks started warm: {summary['ranks_warm']}, cold: {summary['ranks_cold']}"
    return text + ".\n"
