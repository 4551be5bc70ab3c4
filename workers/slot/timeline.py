"""Where one rank's seconds went: its launch, its start-up phases and its measured window.

Why: most of an experiment can be start-up rather than measurement (on the 2-core machine, up to
0.80 of the README example's wall). To cut it, each phase has to be seen, in every record. A rank already
has the clocks: `workers.process.launch` knows when the process was started and when it was gone,
`workers.in_rank.entry` notes when the interpreter reached it ("up"), `workers.in_rank.step_clock` when DeepSpeed
had been imported ("imports"), when the engine was built ("engine": `deepspeed.initialize`
returns right after) and when each optimizer step ended. `rank_timeline` turns them into seconds
since the launch; pure, no I/O, tested directly.

    launched 0 -> up -> imports -> engine -> first_step -> window_start -> window_end -> ended

`window_start`/`window_end`: the end of the step before the profiled window and the end of its
last step (`workers.in_rank.step_clock.window_seconds`'s steps). Start-up is launch to engine ready;
`startup_share` is the share of a launch that is not measurement, 1 - (end_profile_step + 1) x step latency / wall.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from workers.in_rank.metrics import AutotuningSettings

MOMENTS = ("up", "imports", "engine")


def rank_timeline(launched: float, ended: float, moments: Mapping[str, Any], step_ends: Sequence[Sequence[float]],
                  start_profile_step: int, end_profile_step: int) -> dict[str, float]:
    """Seconds since `launched` (wall clock) of each moment the rank noted, in order; a moment not
    noted (a script without DeepSpeed, a rank that died early) or outside the launch is left out.
    `moments` is the exit report's (`workers.in_rank.step_clock.moments`), whose `clock_offset` turns the
    step ends (perf_counter) into wall-clock time."""
    marks: dict[str, float] = {}
    for name in MOMENTS:
        at = moments.get(name)
        if _number(at):
            marks[name] = at
    offset = moments.get("clock_offset")
    steps = {int(step): at + offset for step, at in step_ends} if _number(offset) else {}
    if steps:
        marks["first_step"] = steps[min(steps)]
    if start_profile_step in steps and end_profile_step + 1 in steps:
        marks["window_start"] = steps[start_profile_step]
        marks["window_end"] = steps[end_profile_step + 1]
    marks["ended"] = ended
    timeline = {"launched": 0.0}
    for name, at in marks.items():
        if launched <= at <= ended + 1.0:
            timeline[name] = round(max(0.0, at - launched), 3)
    return timeline


def launch_timeline(launched: float, ended: float, moments: Mapping[str, Any] | None,
                    step_ends: Sequence[Sequence[float]] | None, ds_config: Mapping[str, Any]) -> dict[str, float]:
    """`rank_timeline` with the profiled window the experiment's DeepSpeed config sets."""
    settings = AutotuningSettings.from_ds_config(ds_config)
    return rank_timeline(launched, ended, moments or {}, step_ends or [], settings.start_profile_step,
                         settings.end_profile_step)


def startup_seconds(timeline: Mapping[str, float]) -> float | None:
    """Launch to engine ready: what a rank spent before it could train (None when not noted)."""
    return timeline.get("engine")


def startup_share(wall_s: float, latency_us: float, end_profile_step: int) -> float | None:
    """1 - (end_profile_step + 1) x step latency / wall: the share of an experiment's wall that the
    steps its config asks for do not explain: start-up and waits. None without a wall or a latency."""
    if not _number(wall_s) or not _number(latency_us) or wall_s <= 0 or latency_us <= 0:
        return None
    return 1.0 - (end_profile_step + 1) * latency_us / 1e6 / wall_s


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
