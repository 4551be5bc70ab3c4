"""scheduler.search.measured_fit: a model that fits only with a memory strategy, learned from the
probes, on a real trace (bench/traces/train_gpt_ckpt.json: the GPT example's 12-layer model on this
machine, every config plain and checkpointed, host-memory peaks 587-952 MiB plain, 537-626 MiB
checkpointed; the profile run's 517 MiB)."""
from __future__ import annotations

import json
from pathlib import Path

from bench.trace_replay import Trace, ours

TRACE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "train_gpt_ckpt.json"
#: 570 MiB: no plain config fits (micro-batch 1 peaks at 587), checkpointed micro-batch 1-2 do.
TIGHT = 570 << 20


def _trace(capacity: int, strategies: bool = True) -> Trace:
    data = json.loads(TRACE.read_text())
    if not strategies:
        data["strategies"] = []
    return Trace(data, capacity=capacity)


def test_a_job_whose_probes_all_ran_out_of_memory_tries_the_allowed_strategy() -> None:
    """The profile's peak says micro-batch 1 fits 570 MiB, its probe runs out of memory: the search
    runs checkpointed, as the user allowed, and names a checkpointed config (none was named before)."""
    for seed in range(5):
        found = ours(_trace(TIGHT), seed, TIGHT)
        assert found.named.endswith("checkpointed") and found.right, found
        assert found.launches <= 8, found


def test_without_the_strategy_allowed_nothing_is_tried_in_its_place() -> None:
    found = ours(_trace(TIGHT, strategies=False), 0, TIGHT)
    assert found.named == "none" and found.launches == 2  # the profile and the probe that failed


def test_where_a_plain_config_runs_the_search_keeps_no_strategy_of_its_own() -> None:
    """At 600 MiB plain micro-batch 1 fits (and beats every checkpointed config): it is named."""
    capacity = 600 << 20
    found = ours(_trace(capacity), 0, capacity)
    assert found.named == "z1 mbs 1 gas 1" and found.right, found
