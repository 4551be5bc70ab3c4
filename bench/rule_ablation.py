"""Each rule of our search switched off in turn, on scripts it was not tuned on: what the rule buys.

Why: the sampled search grew a rule for each miss of bench/search_quality.py, and a rule fitted to
one bench need not carry to scripts that bench does not hold. Here each named rule (`RULES`) is
switched off alone and our search replayed, with and without it, on the same scripts: held-out
seeds of the synthetic families (bench/surfaces.py; 1000 and above by default) and bench/heldout.py's
families written apart, or, for the memory strategies' rules, the needs-strategy family. Per rule it
prints the mean and 10th percentile of the fraction of the optimum (an aborted search counts 0),
the launches summed, the searches with more than 4 failed probes, and how many searches the rule
moved by more than 1 % of the optimum either way (and how many of bench/heldout.py's). A rule that
buys nothing on any of them and costs launches is one to remove; one whose removal loses picks stays.

    .venv/bin/python bench/rule_ablation.py [--seed 1000] [--surfaces 60] [--heldout 40] [--rule sawtooth ...]
"""
from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import heldout, search_quality  # noqa: E402
from bench.stats import quantile  # noqa: E402
from bench.surfaces import FAMILIES, make_surface  # noqa: E402
from scheduler.search.cost_model import trimmed_fit  # noqa: E402

#: Searches with more than this many failed probes are counted (issue 32's goal, as search_quality's).
FAILED_GOAL = search_quality.FAILED_GOAL
#: A search moved by more than this fraction of the optimum counts as won or lost by the rule.
MOVED = 0.01


def _no_phases(*_args: Any, **_kwargs: Any) -> Any:
    """A step of the search that measures nothing (a generator with no phase, returning None)."""
    yield from ()


def _no_phases_false(*_args: Any, **_kwargs: Any) -> Any:
    """As `_no_phases`, for a step whose caller reads False as "nothing measured"."""
    yield from ()
    return False


def _none(*_args: Any, **_kwargs: Any) -> None:
    return None


def _false(*_args: Any, **_kwargs: Any) -> bool:
    return False


def _true(*_args: Any, **_kwargs: Any) -> bool:
    return True


def _empty(*_args: Any, **_kwargs: Any) -> dict[Any, Any]:
    return {}


@dataclass(frozen=True)
class Rule:
    """One rule of the search and how it is switched off: `module.attribute` replaced by `off`."""

    name: str
    module: str
    attribute: str
    off: Any
    strategies: bool  #: measured on the needs-strategy family (else the synthetic and held-out ones)
    what: str


_FOLLOW, _SAMPLED, _FAST = "scheduler.search.stage_follow", "scheduler.search.sampled_search", "scheduler.search.fast_search"
_STRATEGY, _READINGS = "scheduler.search.strategy_search", "scheduler.search.stage_readings"
RULES = (
    Rule("aligned-top", "scheduler.search.stage_space", "ALIGN_FROM", math.inf, False,
         "a top of 128 or more probed at a multiple of 8"),
    Rule("zero3-room", _FOLLOW, "ZERO3_ROOM", math.inf, False, "ZeRO-3 explored when it holds 1.3x ZeRO-1/2's top"),
    Rule("zero3-at-scale", _FOLLOW, "ZERO3_AT_SCALE", 10**9, False, "ZeRO-3 measured once from 4 ranks on"),
    Rule("half-step", _FOLLOW, "_half_step", _false, False, "a stage filling under half the step not measured"),
    Rule("same-micro-steps", _FOLLOW, "_same_micro_steps", _false, False, "ZeRO-0 beside ZeRO-1 measured once"),
    Rule("fuller-step", _FOLLOW, "_fuller_step", _none, False, "the size filling the step with one gas less"),
    Rule("robust-curve", "scheduler.search.ceilings", "robust_fit", trimmed_fit, False,
         "a curve's fit less the few readings it cannot explain, not one"),
    Rule("nearest-reading", "scheduler.search.ranking", "unsettled_readings", _empty, False,
         "three readings that disagree ranked at the one nearest the curve"),
    Rule("predicted-worse", _SAMPLED, "predicted_worse", _none, False, "a size the fit says cannot lead, skipped"),
    Rule("predicted-better", _SAMPLED, "predicted_better", _none, False, "a size the fit says leads, measured"),
    Rule("unchecked-top", _SAMPLED, "above_unchecked_top", _none, False, "a leading top no peak checked, probed above"),
    Rule("short-curve", _READINGS, "_torn_pair", _none, False, "a size far below a smaller one of a short curve, read again"),
    Rule("sawtooth", _FAST, "try_sawtooth", _no_phases, False, "the leader's saw-tooth neighbour"),
    Rule("widen-step", _FAST, "widen_step", _no_phases, False, "an accumulating leader's step widened to the top"),
    Rule("roomier-stage", _STRATEGY, "_roomier_stage", _no_phases, True, "the best strategy at the roomiest stage"),
    Rule("first-that-pays", _STRATEGY, "_one_more_paid", _false, True,
         "once a strategy pays, the rest only stacked on it"),
    Rule("stacking", _STRATEGY, "_stacking_base", _none, True, "strategies stacked on the one that paid"),
    Rule("cautious-span", _STRATEGY, "CAUTIOUS_SPAN", math.inf, True, "a far strategy top probed half way first"),
    Rule("checked-line", _STRATEGY, "_prior_line", _true, True, "no half way first once any stage checked the line"),
    Rule("ran-near", _STRATEGY, "_ran_near", _false, True, "no strategy size within 5 % of one that ran"),
    Rule("strategies-first", _SAMPLED, "strategies_pay_first", _no_phases_false, True,
         "strategies from the lead stage's top before its refinement"),
    Rule("offload-swap", _FAST, "swap_own_offload", _no_phases, True, "own optimizer offload swapped at ZeRO-3"),
)


def switched_off(rule: Rule) -> AbstractContextManager[Any]:
    """A context in which `rule` is off (its attribute replaced, restored on exit)."""
    return mock.patch.object(importlib.import_module(rule.module), rule.attribute, rule.off)


def scripts(strategies: bool, seed: int, surfaces: int, held: int) -> list[tuple[Any, Callable[[Any], Any], bool]]:
    """(script, our search on it, whether bench/heldout.py wrote it) for each script a rule is
    measured on (module docstring)."""
    if strategies:
        found = [make_surface("needs-strategy", s) for s in range(seed, seed + surfaces)]
        return [(surface, search_quality.ours, False) for surface in found if surface.optimum()[0] > 0]
    synthetic = [make_surface(family, s) for family in FAMILIES for s in range(seed, seed + surfaces)]
    written_apart = [heldout.make_script(family, s) for family in heldout.FAMILIES for s in range(seed, seed + held)]
    return [(surface, search_quality.ours, False) for surface in synthetic if surface.optimum()[0] > 0] + \
        [(script, heldout.ours, True) for script in written_apart]


def moved(on: list[Any], off: list[Any]) -> tuple[int, int]:
    """(searches the rule won, searches it lost): named configs more than MOVED of the optimum apart."""
    won = sum((a.fraction or 0) > (b.fraction or 0) + MOVED for a, b in zip(on, off))
    return won, sum((b.fraction or 0) > (a.fraction or 0) + MOVED for a, b in zip(on, off))


def summary(outcomes: list[Any]) -> tuple[float, float, int, int]:
    """(mean fraction, 10th percentile as bench/search_quality.py takes it, launches, searches over
    FAILED_GOAL failed probes)."""
    fractions = [o.fraction or 0.0 for o in outcomes]
    return (statistics.mean(fractions), quantile(fractions, 0.1),
            sum(o.launches for o in outcomes), sum(o.failed > FAILED_GOAL for o in outcomes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1000, help="first seed of every family (default 1000: held out)")
    parser.add_argument("--surfaces", type=int, default=60, help="synthetic scripts per family (default 60)")
    parser.add_argument("--heldout", type=int, default=40, help="bench/heldout.py scripts per family (default 40)")
    parser.add_argument("--rule", choices=[rule.name for rule in RULES], action="append", help="only these rules")
    args = parser.parse_args()
    rules = [rule for rule in RULES if not args.rule or rule.name in args.rule]
    print(f"RULE ABLATION: our search with each rule on, then off, seeds {args.seed}..; synthetic families "
          f"x {args.surfaces} and bench/heldout.py's x {args.heldout}, or needs-strategy x {args.surfaces}")
    print(f"{'rule':<18}{'scripts':>8}{'mean on/off':>15}{'p10 on/off':>14}{'launches on/off':>17}"
          f"{'>4 failed':>11}{'won/lost':>10}{'heldout.py':>12}  what it does")
    baselines: dict[bool, tuple[list[Any], list[Any]]] = {}  #: strategy rules or not -> (scripts, outcomes on)
    for rule in rules:
        if rule.strategies not in baselines:
            found = scripts(rule.strategies, args.seed, args.surfaces, args.heldout)
            baselines[rule.strategies] = found, [search(script) for script, search, _ in found]
        triples, on = baselines[rule.strategies]
        with switched_off(rule):
            off = [search(script) for script, search, _ in triples]
        apart = [i for i, (_, _, written_apart) in enumerate(triples) if written_apart]
        (won, lost), (won_apart, lost_apart) = moved(on, off), moved([on[i] for i in apart], [off[i] for i in apart])
        (mean_on, p10_on, launch_on, fail_on), (mean_off, p10_off, launch_off, fail_off) = summary(on), summary(off)
        print(f"{rule.name:<18}{len(triples):>8}{f'{mean_on:.4f}/{mean_off:.4f}':>15}{f'{p10_on:.3f}/{p10_off:.3f}':>14}"
              f"{f'{launch_on}/{launch_off}':>17}{f'{fail_on}/{fail_off}':>11}{f'{won}/{lost}':>10}"
              f"{f'{won_apart}/{lost_apart}' if apart else '-':>12}  {rule.what}")


if __name__ == "__main__":
    main()
