"""bench/rule_ablation.py switches each named rule of the search off, and only while asked.

Why: the ablation's verdicts are only as good as its switches. A rule whose module or attribute was
renamed would make the bench fail loudly (good), but a switch that replaces the wrong thing, or one
left switched off after its context, would print a rule as buying nothing, or leave every later
search in the run without it. Checked on a handful of synthetic surfaces, in about a second.
"""
from __future__ import annotations

import importlib
import numbers

import pytest

from bench import rule_ablation, search_quality
from bench.surfaces import make_surface


@pytest.mark.parametrize("rule", rule_ablation.RULES, ids=lambda rule: rule.name)
def test_every_rule_names_a_switch_of_its_kind(rule: rule_ablation.Rule) -> None:
    """A function is replaced by a function, a constant by a number, and the original comes back."""
    module = importlib.import_module(rule.module)
    original = getattr(module, rule.attribute)
    assert callable(original) == callable(rule.off)
    assert isinstance(original, numbers.Number) == isinstance(rule.off, numbers.Number)
    with rule_ablation.switched_off(rule):
        assert getattr(module, rule.attribute) is rule.off
    assert getattr(module, rule.attribute) is original


def test_a_rule_switched_off_changes_the_searches_it_decides() -> None:
    """ZeRO-0 beside a ZeRO-1 incumbent is measured once at its config (`_same_micro_steps`); with the
    rule off it is sampled and refined like any stage, so the same surfaces take more launches."""
    rule = next(rule for rule in rule_ablation.RULES if rule.name == "same-micro-steps")
    surfaces = [make_surface(family, seed) for family in ("monotone", "mid-peak") for seed in range(1000, 1006)]
    on = [search_quality.ours(surface).launches for surface in surfaces]
    with rule_ablation.switched_off(rule):
        off = [search_quality.ours(surface).launches for surface in surfaces]
    assert sum(off) > sum(on), (on, off)
    assert [search_quality.ours(surface).launches for surface in surfaces] == on


def test_the_summary_counts_an_aborted_search_as_nothing_named() -> None:
    outcome = search_quality.Outcome(0.9, 10, 5, 3, 0, False)
    aborted = rule_ablation.heldout.Outcome(None, 4, 1)
    mean, p10, launches, over_goal = rule_ablation.summary([outcome, aborted])
    assert (mean, p10, launches, over_goal) == (pytest.approx(0.45), 0.0, 14, 1)
