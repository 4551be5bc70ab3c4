"""How a rank was started, warm or cold, and why: what its record says (`start_path`,
`cold_because`), and a launch recorded lost when the warm process it was forked from died while it
ran (its exit status is unknown, so the end is not the config's).

Apart from the warm process itself (`workers.warm.warm_start`) because the rank and its record
(`workers.slot.rank`, `workers.slot.rank_record`) read these whether the warm path served the launch or not.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

#: The warm path's own log: a rank recorded lost is its news, beside its other messages.
log = logging.getLogger("workers.warm.warm_start")


@dataclass
class Start:
    """How one launch was started: the record's `start_path` and, when cold, why; `lost` when its warm
    process died while it ran (how the rank ended is unknown: the launch is lost, not the config's)."""

    path: str = "cold"
    why_cold: str = ""
    lost: str = ""


class WarmUnavailable(Exception):
    """The warm path cannot serve this launch; the message says why (the record's `cold_because`)."""


def recorded_lost(start: Start, why: str, stderr: str) -> None:
    """The launch is lost (`Start.lost`); the rank's stderr (the record's tail) and the log say why."""
    start.lost = why
    log.warning("warm start: a rank's %s; the launch is recorded lost", why)
    try:
        with open(stderr, "a") as handle:
            handle.write(f"\nworkers.warm.warm_start: {why}; the launch is recorded lost, not as this config's end\n")
    except OSError:
        pass
