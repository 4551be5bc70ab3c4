"""The cost model's check in the results: a section of summary.txt and `model_fit.png`, predicted
against measured for every config the fit of its stage's other configs could predict.

Why: the search decides through a fitted model (`scheduler.search.cost_model`); the user sees, next
to the pick, how far that model was from what was read (`scheduler.search.fit_check`), so a script
whose curve is not the model's shows it at once.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tabulate import tabulate

from scheduler.search.fit_check import FitCheck, median_error


def fit_text(rows: Sequence[FitCheck]) -> str:
    """The summary's section (empty when no config had three others in its space to fit)."""
    checked = [row for row in rows if row.predicted is not None]
    if not checked:
        return ""
    table = tabulate([[row.name, row.space, row.mbs, row.gas, round(row.read, 3), row.readings,
                       round(row.predicted, 3), f"{row.ratio:.3f}"] for row in checked],
                     headers=["config", "space", "mbs", "gas", "read", "readings", "predicted", "read/predicted"],
                     tablefmt="pipe")
    error = median_error(checked)
    return ("\nCost model (seconds per sample = a/mbs + b + c/(mbs x gas) + d x mbs, fitted per stage): each "
            "config's reading against the fit of its stage's other configs; a reading it contradicted was "
            f"measured again. Median error {100 * error:.1f} %.\n{table}\n")


def write_fit_plot(path: Path, rows: Sequence[FitCheck], metric: str) -> bool:
    """Predicted against measured, one colour per space, with the y = x line; False (and no file)
    when there is nothing to plot."""
    checked = [row for row in rows if row.predicted is not None]
    if not checked:
        path.unlink(missing_ok=True)
        return False
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(5.5, 5), dpi=110)
    for space in dict.fromkeys(row.space for row in checked):
        mine = [row for row in checked if row.space == space]
        axes.plot([row.predicted for row in mine], [row.read for row in mine], "o", label=space, alpha=0.8)
    top = max(max(row.read, row.predicted) for row in checked) * 1.05
    axes.plot([0, top], [0, top], "-", color="grey", linewidth=1, label="read = predicted")
    axes.set_xlim(0, top)
    axes.set_ylim(0, top)
    axes.set_xlabel(f"{metric} predicted by the fit of the stage's other configs")
    axes.set_ylabel(f"{metric} read")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    axes.set_title("celery-autotune: the cost model against the readings")
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
    return True
