"""`tuning.png`: what the search measured, at a glance.

One point per experiment: micro-batch size per GPU against the metric, one colour per tuning space
(a ZeRO stage, or a full-mode space), failed probes drawn as crosses on the x axis labelled with
their failure class, and the winner ringed. It shows what a table hides: where memory ended the
search (the OOM crosses right of the last point) and how flat the curve is near the optimum.
Written with matplotlib's Agg backend: no display needed on a control worker.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from scheduler.ranking import metric_value
from scheduler.space import PROFILE, Experiment


def write_plot(path: Path, experiments: list[Experiment], records: dict[str, dict[str, Any]],
               metric: str, winner: dict[str, Any] | None) -> None:
    """Draw every measured experiment of the search into `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4.5), dpi=110)
    spaces: dict[str, list[tuple[Experiment, dict[str, Any]]]] = {}
    for exp in experiments:
        if exp.name in records and exp.space != PROFILE:
            spaces.setdefault(exp.space, []).append((exp, records[exp.name]))
    for space, measured in spaces.items():
        good = sorted((exp.micro_batch_size, value) for exp, record in measured
                      if (value := metric_value(record, metric)) is not None)
        failed = [(exp.micro_batch_size, record.get("status", "?")) for exp, record in measured
                  if metric_value(record, metric) is None]
        line, = axes.plot([m for m, _ in good], [v for _, v in good], "o-", label=space, alpha=0.8)
        if failed:
            axes.plot([m for m, _ in failed], [0] * len(failed), "x", color=line.get_color(), markersize=9,
                      clip_on=False)
            for mbs, status in failed:
                axes.annotate(status, (mbs, 0), textcoords="offset points", xytext=(0, 6), fontsize=7,
                              ha="center", color=line.get_color())
    if winner is not None and (value := metric_value(winner, metric)) is not None:
        mbs = next(e.micro_batch_size for e in experiments if e.name == winner["name"])
        axes.plot([mbs], [value], "o", markersize=16, markerfacecolor="none", markeredgecolor="black",
                  label=f"best: {winner['name']}")
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
