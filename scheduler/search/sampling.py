"""The sampled search's pure decisions: which micro-batch size to measure next in a stage, the sizes
worth measuring, the order of the stages, the saw-tooth neighbour of the leader.

Why its own module: these take numbers and return numbers (no session, no records), so they are
tested on their own (tests/unit/test_sampled_search.py, test_sawtooth.py) and read apart from
`scheduler.search.sampled_search`, which turns them into phases over what was measured.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

#: Refinement stops when the best size's measured neighbours are within this ratio of it.
REFINE_RATIO = 1.45
#: A larger top (the memory line moved up after a probe) is probed only if it is at least this much
#: larger than the largest size measured: a few percent more samples per micro-step change the
#: throughput by less than the measurement noise.
TOP_GAIN = 1.1
#: The leader's neighbour along the accumulation saw-tooth (one step more, the largest size that
#: fills it) is measured when it trains at least this many times the leader's samples per step.
SAWTOOTH_GAIN = 1.05


#: A reading the cost model contradicts is measured again only where it could matter: the reading or
#: its prediction at least this share of the stage's best reading.
RIVAL_SHARE = 0.7


def geometric_mid(low: int, high: int) -> int | None:
    """The integer nearest sqrt(low * high), strictly between them, or None if there is none."""
    if high - low < 2:
        return None
    mid = round(math.sqrt(low * high))
    return min(max(mid, low + 1), high - 1)


def full_step_sizes(samples_per_step: int | None, top: int) -> list[int]:
    """The sizes worth measuring up to `top`: with a samples-per-step limit L, the largest size for
    each accumulation g (L // g), since any smaller size with the same g only wastes part of the
    step; without a limit every size. `top` itself is always one (the largest that fits)."""
    if top < 1:
        return []
    if not samples_per_step:
        return list(range(1, top + 1))
    return sorted({samples_per_step // g for g in range(1, samples_per_step + 1)
                   if 1 <= samples_per_step // g <= top} | {min(top, samples_per_step)})


def snap(target: float, sizes: Sequence[int]) -> int:
    """The size in `sizes` nearest `target` on a log scale."""
    return min(sizes, key=lambda m: (abs(math.log(m / target)), m))


def next_size(values: Mapping[int, float | None], sizes: Sequence[int], maximize: bool = True,
              best: int | None = None) -> int | None:
    """The next micro-batch size to measure in one stage, or None when the stage is done.

    `values`: size -> metric (None: failed). `sizes`: the sizes allowed now (`full_step_sizes` up to
    the largest size memory allows, below every failure). The largest is always seen; then the
    larger log-gap next to the best size is split at the allowed size nearest its geometric middle,
    going four times lower when the best is the smallest size measured; a gap narrower than
    REFINE_RATIO, or with no allowed size inside, is not split. `best`: the size to refine around,
    when a measured size that ran (the cost model's best among readings the noise cannot order);
    else the best reading.
    """
    if not sizes:
        return None
    top = sizes[-1]
    ok = sorted(m for m, v in values.items() if v is not None and m <= top)
    if not ok or (top >= ok[-1] * TOP_GAIN and top not in values):
        return top if top not in values else None
    if best not in ok:
        best = max(ok, key=lambda m: (values[m] if maximize else -values[m], -m))
    index = ok.index(best)
    options: list[tuple[float, int]] = []

    gaps = ([(ok[index - 1], best)] if index else []) + ([(best, ok[index + 1])] if index + 1 < len(ok) else [])
    for low, high in gaps:
        inside = [m for m in sizes if low < m < high and m not in values]
        if inside and high / low > REFINE_RATIO:
            options.append((math.log(high / low), snap(math.sqrt(low * high), inside)))
    if index == 0 and not options:
        below = [m for m in sizes if m < best and m not in values]
        if below:
            options.append((math.log(4), snap(max(1.0, best / 4), below)))
    if not options:
        return None
    return max(options)[1]


def lead_first(stages: Sequence[int], dp_size: int) -> list[int]:
    """The order stages are searched in: ZeRO-1 first when data parallelism shards anything (it holds
    at least what ZeRO-0 holds, moves the same data and runs 1/dp of the optimizer step, so it is
    the stage most likely to win and its curve is the one worth sampling), then the rest in order."""
    ordered = list(stages)
    if dp_size > 1 and 1 in ordered:
        ordered.remove(1)
        ordered.insert(0, 1)
    return ordered


def filled_size(mbs: int, gas: int, samples_per_step: int | None) -> int | None:
    """The size filling the step at the leader's own accumulation (samples_per_step // gas), when it
    trains at least SAWTOOTH_GAIN times the leader's samples per step (a leader measured as a stage's
    provisional top, 12 x 2 of a step of 32 before later probes showed the stage holds 16, leaves
    part of its step unfilled: the same micro-steps could train more samples for the same fixed
    costs); None when there is no step limit or the leader fills it already."""
    if not samples_per_step:
        return None
    size = samples_per_step // max(1, gas)
    return size if size >= SAWTOOTH_GAIN * mbs else None


def sawtooth_neighbour(mbs: int, gas: int, samples_per_step: int | None) -> int | None:
    """The size one accumulation step further along the saw-tooth from (mbs, gas): the largest that
    fills samples_per_step // (gas + 1) per micro-step, when it is smaller than `mbs` and fills at
    least SAWTOOTH_GAIN times the samples per step (mbs 26 x gas 5 = 130 beside 27 x 4 = 108 when
    the step allows 130: the top of a stage rarely fills it); None when there is none."""
    if not samples_per_step:
        return None
    size = samples_per_step // (gas + 1)
    if not 1 <= size < mbs or size * (samples_per_step // size) < SAWTOOTH_GAIN * mbs * gas:
        return None
    return size
