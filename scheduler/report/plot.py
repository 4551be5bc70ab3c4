"""`tuning.png`: what the search measured, at a glance.

One point per experiment: micro-batch size per GPU against the metric, one colour per tuning space
(a ZeRO stage, or a full-mode space), failed probes drawn as crosses on the x axis labelled with
their failure class, and the winner ringed. It shows what a table hides: where memory ended the
search (the OOM crosses right of the last point) and how flat the curve is near the optimum.
Written with matplotlib's Agg backend: no display needed on a control worker.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from scheduler.report.rows import Row
from scheduler.search.ranking import metric_value, status_word
from scheduler.search.space import PROFILE, Experiment
from workers.slot.records import ExperimentRecord


def write_plot(path: Path, experiments: list[Experiment], records: Mapping[str, ExperimentRecord],
               metric: str, winner: ExperimentRecord | None) -> None:
    """Draw every measured experiment of the search into `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4.5), dpi=110)
    spaces: dict[str, list[tuple[Experiment, ExperimentRecord]]] = {}
    for exp in experiments:
        if exp.name in records and exp.space != PROFILE:
            spaces.setdefault(exp.space, []).append((exp, records[exp.name]))
    for space, measured in spaces.items():
        good = sorted((exp.micro_batch_size, value) for exp, record in measured
                      if (value := metric_value(record, metric)) is not None)
        failed = [(exp.micro_batch_size, status_word(record)) for exp, record in measured
                  if metric_value(record, metric) is None]
        line, = axes.plot([m for m, _ in good], [v for _, v in good], "o-", label=space, alpha=0.8)
        if failed:
            axes.plot([m for m, _ in failed], [0] * len(failed), "x", color=line.get_color(), markersize=9,
                      clip_on=False)
            for mbs, status in failed:
                axes.annotate(status, (mbs, 0), textcoords="offset points", xytext=(0, 6), fontsize=7,
                              ha="center", color=line.get_color())
    if winner is not None and (value := metric_value(winner, metric)) is not None:
        mbs = next(e.micro_batch_size for e in experiments if e.name == winner.name)
        axes.plot([mbs], [value], "o", markersize=16, markerfacecolor="none", markeredgecolor="black",
                  label=f"best: {winner.name}")
    axes.set_xlabel("micro-batch size per GPU")
    axes.set_ylabel(metric)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    if spaces:
        axes.legend(fontsize=8)
    axes.set_title("celery-autotune: every experiment of the search")
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


#: One colour per outcome class, the same in every timeline: green measured, red memory, grey cut off.
STATUS_COLOURS = {"ok": "#2ca02c", "oom": "#d62728", "timeout": "#ff7f0e", "crashed": "#9467bd",
                  "no_metrics": "#8c564b", "bad_metrics": "#e377c2", "rendezvous_failed": "#bcbd22",
                  "aborted": "#17becf", "lost": "#7f7f7f", "cancelled": "#c7c7c7"}


def write_timeline(path: Path, records: Sequence[Row], winner: Row | None) -> None:
    """`timeline.png`: which slot ran what, when. One row per slot, one bar per experiment on each
    slot it held (a gang spans rows), from its start to its end in seconds since the first start,
    coloured by outcome, its start-up (launch to engine ready, `startup_of`) hatched; the winner
    outlined. Gaps are idle slots, long bars the costly probes, long hatches the costly starts."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot
    from matplotlib.patches import Patch

    timed = [r for r in records if r.started_at and r.ended_at and r.slots]
    slots = sorted({slot for r in timed for slot in r.slots})
    figure, axes = pyplot.subplots(figsize=(10, 1.2 + 0.55 * max(len(slots), 1)), dpi=110)
    origin = min((r.started_at for r in timed), default=0.0)
    span = max((r.ended_at - origin for r in timed), default=1.0) or 1.0
    for record in timed:
        start, width = record.started_at - origin, max(record.ended_at - record.started_at, 0.01)
        colour = STATUS_COLOURS.get(status_word(record), "#7f7f7f")
        is_winner = winner is not None and record.name == winner.name
        startup = min(startup_of(record) or 0.0, width)
        for slot in record.slots:
            row = slots.index(slot)
            axes.barh(row, width, left=start, height=0.7, color=colour, alpha=0.9,
                      edgecolor="black" if is_winner else "white", linewidth=2.0 if is_winner else 0.5)
            if startup:  # launch to engine ready: hatched over the bar's first part
                axes.barh(row, startup, left=start, height=0.7, color="white", alpha=0.45, hatch="////",
                          edgecolor="#404040", linewidth=0)
            axes.text(start + width / 2, row, record.name, ha="center", va="center", fontsize=6,
                      rotation=90 if width < 0.08 * span else 0, clip_on=True)
    axes.set_yticks(range(len(slots)), slots)
    axes.invert_yaxis()
    axes.set_xlabel("seconds since the first experiment started")
    axes.grid(axis="x", alpha=0.3)
    present = sorted({status_word(r) for r in timed})
    handles = [Patch(color=STATUS_COLOURS.get(status, "#7f7f7f"), label=status) for status in present]
    if any(startup_of(r) for r in timed):
        handles.append(Patch(facecolor="white", edgecolor="#404040", hatch="////", label="start-up"))
    if winner is not None:
        handles.append(Patch(facecolor="white", edgecolor="black", linewidth=2, label=f"best: {winner.name}"))
    if handles:
        axes.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes.set_title("celery-autotune: experiments per slot over time")
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


def startup_of(record: Row) -> float | None:
    """Seconds from the experiment's start to its slowest rank's engine ready (None when a rank did
    not note it, or none was recorded): the rank timelines count from each rank's own launch, the bar
    from the first. Each rank's phases are in its JSON, as `scheduler.report.startup` reads them."""
    if not isinstance(record, ExperimentRecord) or record.started_at is None:
        return None
    readies = []
    for rank in record.ranks:
        timeline = rank.get("timeline") if isinstance(rank, dict) else None
        ready = timeline.get("engine") if isinstance(timeline, dict) else None
        if not isinstance(ready, (int, float)) or not isinstance(rank.get("started_at"), (int, float)):
            return None
        readies.append(rank["started_at"] + ready - record.started_at)
    return max(readies) if readies else None
