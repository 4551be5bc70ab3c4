"""Memory strategies tried from the lead stage's top before its refinement
(`scheduler.search.strategy_first`), and the strategy search's two guards that keep a second pass
from the final leader cheap (`strategy_search._prior_line`, `_ran_near`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from bench.surfaces import make_surface
from scheduler.search import strategy_first, strategy_search
from scheduler.search.fast_search import fast_search
from scheduler.search.memory import GiB, MemoryModel
from scheduler.search.phases import drive
from scheduler.search.ranking import best
from scheduler.search.session import Session
from scheduler.search.space import PROFILE, Experiment
from scheduler.search.stage_space import gas_for
from tests.unit.test_strategy_search import TALL, Law, bench_settings, settings

CHECKPOINTING = ("activation_checkpointing",)


@dataclass(frozen=True)
class Launchy(Law):
    """`Law` with a micro-step's fixed cost ten times larger (kernel launches of a small model): the
    throughput rises steeply with the micro-batch up to the memory top (8), so checkpointing's
    larger micro-batch reads about 2.5 times the plain top's."""

    fixed_s: float = 0.45  #: seconds a micro-step costs on top of `Law`'s 0.05

    def run(self, exp: Experiment) -> dict[str, Any]:
        record = super().run(exp)
        if exp.space == PROFILE or "metrics" not in record:
            return record
        samples = exp.micro_batch_size * exp.gradient_accumulation_steps * 4
        step = samples / record["metrics"]["throughput"] + self.fixed_s * exp.gradient_accumulation_steps
        return {**record, "metrics": {"throughput": samples / step, "latency": step * 1e6}}


def _phases(law: Law, **kwargs: Any) -> tuple[list[str], dict[str, dict]]:
    names: list[str] = []
    records: dict[str, dict] = {}

    def run_phase(phase) -> dict[str, dict]:
        names.append(phase.name)
        fresh = {exp.name: law.run(exp) for exp in phase.experiments}
        records.update(fresh)
        return fresh

    drive(fast_search(settings(law, ["activation_checkpointing"], **kwargs)), run_phase)
    return names, records


def test_strategies_are_tried_as_soon_as_the_lead_stages_top_leads_and_the_refinement_goes_on_if_they_do_not_pay():
    """TALL's lead stage (ZeRO-1) reads its top (8) above its low sample (2): the curve rises into the
    memory top, so checkpointing is tried from there before the refinement below the top and before
    any other stage runs. It pays less than `DECISIVE` (a fifth more), so the refinement goes on (4)."""
    phases, _ = _phases(TALL, kept=256)
    first = min(i for i, name in enumerate(phases) if "_strategy_" in name)
    assert phases[:first] == ["z1_sample_2", "z1_sample_8"], phases
    assert "z1_sample_4" in phases[first:], phases
    assert all(not name.startswith(("z0_", "z2_", "z3_")) for name in phases[:first]), phases


@pytest.mark.parametrize("kept", [None, 256])
def test_strategies_that_pay_decisively_end_the_lead_stages_refinement_and_the_others_run_their_tops_only(
        kept: int | None) -> None:
    """With a large fixed cost per micro-step, checkpointing's runs read over `DECISIVE` times the
    plain top's: ZeRO-1's refinement below its top stops, every other stage runs only its top (what
    it holds, how fast; with a kept global batch too, its largest size dividing the batch), and the
    strategies are tried again from the best of those; a checkpointed config is named."""
    law = Launchy(num_params=100_000_000, activation=1_500_000_000)
    phases, records = _phases(law, kept=kept)
    first = min(i for i, name in enumerate(phases) if "_strategy_" in name)
    plain_after = [name for name in phases[first:] if "_strategy_" not in name and not name.startswith("confirm")]
    assert plain_after and all("_top_" in name for name in plain_after), phases
    assert {name[:2] for name in plain_after} == {"z0", "z2", "z3"}, phases
    winner = best([record for name, record in records.items() if not name.startswith(PROFILE)], "throughput", True)
    assert winner["ds_config"]["autotuning"]["memory_strategy"] == ["activation_checkpointing"], winner["name"]


def test_a_run_not_decisive_enough_leaves_the_refinement_to_go_on(monkeypatch) -> None:
    """The same script with `DECISIVE` above what checkpointing pays: ZeRO-1 is refined below its top
    and the other stages are followed as without strategies."""
    monkeypatch.setattr(strategy_first, "DECISIVE", 10.0)
    phases, _ = _phases(Launchy(num_params=100_000_000, activation=1_500_000_000))
    first = min(i for i, name in enumerate(phases) if "_strategy_" in name)
    assert any(name.startswith("z1_sample_") for name in phases[first:]), phases


def _session(law: Law) -> Session:
    search_settings = settings(law, ["activation_checkpointing"])
    session = Session(search_settings)
    session.model = MemoryModel(search_settings.model_info, search_settings.setup, GiB)
    return session


def _measure(session: Session, exp: Experiment, law: Law) -> None:
    session.measured[exp.name] = (exp, law.run(exp))


def test_a_strategy_size_within_top_gain_of_one_that_ran_at_its_stage_is_not_measured_again() -> None:
    session = _session(TALL)
    _measure(session, session.experiment(1, 14, 1, CHECKPOINTING), TALL)
    _measure(session, session.experiment(1, 30, 1, CHECKPOINTING), TALL)
    assert strategy_search._ran_near(session, 1, CHECKPOINTING, 14)
    assert strategy_search._ran_near(session, 1, CHECKPOINTING, 31)  # 31 / TOP_GAIN <= 30
    assert not strategy_search._ran_near(session, 1, CHECKPOINTING, 15)  # 14 < 15 / TOP_GAIN
    assert not strategy_search._ran_near(session, 1, CHECKPOINTING, 28)  # 28 x TOP_GAIN < 30
    assert not strategy_search._ran_near(session, 0, CHECKPOINTING, 14)  # another stage's line
    failed = session.experiment(2, 14, 1, CHECKPOINTING)
    session.measured[failed.name] = (failed, {"name": failed.name, "status": "oom"})
    assert not strategy_search._ran_near(session, 2, CHECKPOINTING, 14)  # out of memory: not measured there


def test_a_line_checked_at_another_stage_is_measured_at_its_top_not_its_middle() -> None:
    """ZeRO-0 at its memory top (8) with a checkpointed line holding about four times that: with no
    checkpointed run anywhere the line is the prior's and its geometric middle runs first; once a
    run at ZeRO-1 measured its peak, the slope is measured (one for every stage) and the line's
    top runs first."""
    law = Law(num_params=100_000_000, activation=1_500_000_000, keep=0.3)

    def first_size(session: Session) -> int:
        leader = session.experiment(0, 8, gas_for(session, 0, 8))
        _measure(session, leader, law)
        _measure(session, session.experiment(0, 9, gas_for(session, 0, 9)), law)  # out of memory: the top is 8
        sizes: list[int] = []

        def run_phase(phase) -> dict[str, dict]:
            sizes.extend(exp.micro_batch_size for exp in phase.experiments)
            return {exp.name: law.run(exp) for exp in phase.experiments}

        drive(strategy_search._measure_strategy(session, leader, CHECKPOINTING, 8, 1), run_phase)
        return sizes[0]

    prior = _session(law)
    assert strategy_search._prior_line(prior, CHECKPOINTING)
    middle = first_size(prior)
    checked = _session(law)
    _measure(checked, checked.experiment(1, 12, 1, CHECKPOINTING), law)
    assert not strategy_search._prior_line(checked, CHECKPOINTING)
    top = first_size(checked)
    assert middle < top and top > strategy_search.CAUTIOUS_SPAN * 8, (middle, top)


def test_no_strategy_size_is_measured_within_top_gain_of_one_that_ran_at_its_stage() -> None:
    """needs-strategy script 3049: the strategies pay decisively from ZeRO-1's top, and at ZeRO-3
    (the roomier stage) their runs climb to 667; tried again from the best of the other stages'
    tops, the lines at ZeRO-3 point at 613-659 again. A size within TOP_GAIN of a run that ran
    there says nothing new about the line and is not measured (without the guard: 668 right after
    667, then 613, 614, 657, 658 and 659: 0.994 of the optimum named either way)."""
    surface = make_surface("needs-strategy", 3049)
    ran: list[tuple[int, tuple[str, ...], int]] = []

    def run_phase(phase) -> dict[str, dict]:
        records = {exp.name: surface.run(exp.name, exp.ds_config, profile=exp.space == PROFILE)
                   for exp in phase.experiments}
        ran.extend((exp.stage, exp.strategy, exp.micro_batch_size) for exp in phase.experiments
                   if exp.strategy and "_r" not in exp.name and records[exp.name]["status"] == "ok")
        return records

    drive(fast_search(bench_settings(surface)), run_phase)
    for i, (stage, strategy, size) in enumerate(ran):
        near = [m for s, g, m in ran[:i] if (s, g) == (stage, strategy)
                and size / strategy_search.TOP_GAIN <= m <= size * strategy_search.TOP_GAIN]
        assert not near, (stage, strategy, size, near, ran)
