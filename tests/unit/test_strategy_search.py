"""Memory strategies in a search (`scheduler.search.strategy_search`), driven with a scripted fake
runner: a model that fits only with a strategy, the refusal naming one when none is allowed, and
the leader at its stage's memory top measured with checkpointing at a larger micro-batch."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import pytest

from bench.search_quality import ours
from bench.surfaces import make_surface, user_config
from scheduler.inputs.memory_strategies import MemoryStrategyKeys
from scheduler.search.fast_search import fast_search
from scheduler.search.global_batch import GlobalBatch
from scheduler.search.memory import GiB, MemoryModel, ModelInfo
from scheduler.search import strategy_search
from scheduler.search.phases import drive
from scheduler.search.ranking import best
from scheduler.search.session import NoStageFits, SearchAborted, SearchSettings, Session
from scheduler.search.space import PROFILE, Experiment, strategy_of
from scheduler.search.stage_space import gas_for
from scheduler.search.strategy_search import try_strategies

CAPACITY = 16 * GiB
RESERVE = GiB  #: memory.untracked_reserve_bytes of a 16 GiB GPU


@dataclass(frozen=True)
class Law:
    """Memory and speed of a model on 4 ranks, fp16, with offload and checkpointing honoured."""

    num_params: int
    activation: int  #: bytes per sample without checkpointing
    keep: float = 0.25  #: the share of activations checkpointing really keeps (the prior says 0.3)
    peak: int = 0  #: > 0: a sample costs more past this micro-batch (the curve turns below the memory top)
    factor: float = 1.0  #: the states' real bytes over the 16 per parameter the model counts (buffers, copies)
    peaks: bool = True  #: the records carry the measured peak
    backward: int = 0  #: bytes a training step holds beyond the profile's forward

    def memory(self, exp: Experiment) -> int:
        n, s, dp = self.num_params, exp.stage, 4
        params = 0 if "offload_param" in exp.strategy else 2 * n / (dp if s >= 3 else 1)
        grads = 2 * n / (dp if s >= 2 else 1)
        optimizer = 0 if "offload_optimizer" in exp.strategy else 12 * n / (dp if s >= 1 else 1)
        share = self.keep if "activation_checkpointing" in exp.strategy else 1.0
        states = (params + grads + optimizer) * self.factor
        return int(states + GiB + self.activation * share * exp.micro_batch_size)

    def run(self, exp: Experiment) -> dict[str, Any]:
        peak = self.memory(exp) + (0 if exp.space == PROFILE else self.backward)
        if peak > CAPACITY - RESERVE:
            return {"name": exp.name, "status": "oom", "ds_config": exp.ds_config}
        if exp.space == PROFILE:
            return {"name": exp.name, "status": "ok", "peak_device_bytes": peak, "ds_config": exp.ds_config,
                    "metrics": {"num_params": self.num_params, "activation_mem_per_gpu": self.activation}}
        compute = 0.01 * exp.micro_batch_size * (4 / 3 if "activation_checkpointing" in exp.strategy else 1)
        if self.peak and exp.micro_batch_size > self.peak:
            compute *= exp.micro_batch_size / self.peak
        micro = 0.05 + compute + 0.002 * exp.stage
        step = micro * exp.gradient_accumulation_steps + (0.5 if "offload_optimizer" in exp.strategy else 0)
        samples = exp.micro_batch_size * exp.gradient_accumulation_steps * 4
        return {"name": exp.name, "status": "ok", "peak_device_bytes": peak if self.peaks else None,
                "ds_config": exp.ds_config, "metrics": {"throughput": samples / step, "latency": step * 1e6}}


def settings(law: Law, strategies: list[str], kept: int | None = None, profile: bool = False) -> SearchSettings:
    autotuning: dict[str, Any] = {"enabled": True, "memory_strategies": strategies,
                                  "arg_mappings": {"activation_checkpointing": "--gradient_checkpointing"}}
    config = {"fp16": {"enabled": True}, "zero_optimization": {"stage": "all", "contiguous_gradients": False},
              "autotuning": autotuning}
    info = ModelInfo(law.num_params, law.num_params, law.activation)
    return SearchSettings(ds_config=config, capacity_bytes=CAPACITY, stages=(0, 1, 2, 3), num_gpus=4,
                          model_info=None if profile else info, overhead_bytes=GiB, peak_memory_key="peak_device_bytes",
                          global_batch=GlobalBatch(kept, f"train_batch_size {kept}") if kept else GlobalBatch(),
                          memory_strategies=MemoryStrategyKeys(allowed=strategy_of(strategies)))


def run(law: Law, search_settings: SearchSettings) -> tuple[list[Experiment], dict[str, dict]]:
    experiments: list[Experiment] = []
    records: dict[str, dict] = {}

    def run_phase(phase) -> dict[str, dict]:
        experiments.extend(phase.experiments)
        records.update({exp.name: law.run(exp) for exp in phase.experiments})
        return {exp.name: records[exp.name] for exp in phase.experiments}

    drive(fast_search(search_settings), run_phase)
    return experiments, records


#: 4e9 parameters: 16 bytes each on one rank at ZeRO-3 (4 ranks) fill more than the 15 GiB budget.
BIG = Law(num_params=4_000_000_000, activation=200_000_000)
#: 1e8 parameters with 20 GB of activations per sample: only checkpointing brings one sample in.
WIDE = Law(num_params=100_000_000, activation=20_000_000_000)


def test_a_model_that_fits_only_with_offload_is_tuned_with_it() -> None:
    experiments, records = run(BIG, settings(BIG, ["offload_optimizer"]))
    assert experiments and all(exp.strategy == ("offload_optimizer",) for exp in experiments)
    assert all(exp.name.endswith(("_oo",)) or "_oo_r" in exp.name for exp in experiments)
    assert {exp.stage for exp in experiments} <= {2, 3}  # ZeRO-1 holds 16 GB of parameters and gradients
    assert all(exp.ds_config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"} for exp in experiments)
    winner = best(list(records.values()), "throughput", True)
    assert winner is not None and winner["status"] == "ok"


def test_without_permission_the_refusal_names_the_strategy_and_the_config_line() -> None:
    with pytest.raises(NoStageFits) as caught:
        run(BIG, settings(BIG, []))
    message = str(caught.value)
    assert "\n" not in message
    assert "the memory model says it fits with offload_optimizer at ZeRO-2" in message
    assert message.endswith('allow it with "autotuning": {"memory_strategies": ["offload_optimizer"]} in the config')


def test_the_cheapest_allowed_strategy_that_fits_is_chosen() -> None:
    experiments, _ = run(WIDE, settings(WIDE, ["offload_optimizer", "activation_checkpointing"]))
    assert experiments and all(exp.strategy == ("activation_checkpointing",) for exp in experiments)
    with pytest.raises(NoStageFits, match="fits with activation_checkpointing at ZeRO-0: allow it with "
                       r'"autotuning": \{"memory_strategies": \["activation_checkpointing"\], "arg_mappings"'):
        run(WIDE, settings(WIDE, ["offload_optimizer"]))


#: 1e8 parameters, 1.5 GB of activations per sample: every stage tops out at micro-batch 8.
TALL = Law(num_params=100_000_000, activation=1_500_000_000)


def test_a_leader_at_its_memory_top_is_measured_with_checkpointing_at_a_larger_size() -> None:
    experiments, records = run(TALL, settings(TALL, ["activation_checkpointing"], kept=256))
    plain = [exp for exp in experiments if not exp.strategy]
    checkpointed = [exp for exp in experiments if exp.strategy == ("activation_checkpointing",)]
    assert max(exp.micro_batch_size for exp in plain if records[exp.name]["status"] == "ok") == 8
    assert checkpointed, "the leader sat at its memory top and checkpointing was allowed"
    for exp in checkpointed:  # a larger micro-batch with less accumulation, the global batch kept
        assert exp.micro_batch_size > 8
        assert exp.micro_batch_size * exp.gradient_accumulation_steps == 64
        assert exp.ds_config["autotuning"]["memory_strategy"] == ["activation_checkpointing"]
    ran = [exp for exp in checkpointed if records[exp.name]["status"] == "ok"]
    assert max(exp.micro_batch_size for exp in ran) == 32  # 16 by the prior share, 32 by the measured one
    winner = best(list(records.values()), "throughput", True)
    assert winner["name"].split("_r")[0].endswith("_ac"), winner["name"]  # recompute costs less than the gas saves


def test_no_strategy_probe_when_the_leader_is_below_its_top_or_none_is_allowed() -> None:
    experiments, _ = run(TALL, settings(TALL, []))
    assert not any(exp.strategy for exp in experiments)
    slow = Law(num_params=100_000_000, activation=50_000_000)  # tops far above the kept share of 64
    experiments, _ = run(slow, settings(slow, ["activation_checkpointing"], kept=256))
    assert not any(exp.strategy for exp in experiments)
    turned = Law(num_params=100_000_000, activation=1_500_000_000, peak=2)  # best at 2 or 4, top 8
    experiments, records = run(turned, settings(turned, ["activation_checkpointing"], kept=256))
    assert max(exp.micro_batch_size for exp in experiments if records[exp.name]["status"] == "ok") == 8
    assert best(list(records.values()), "throughput", True)["ds_config"]["train_micro_batch_size_per_gpu"] < 8
    assert not any(exp.strategy for exp in experiments)


def test_a_strategy_probe_is_no_memory_fact_of_its_stage() -> None:
    search_settings = settings(TALL, ["activation_checkpointing"], kept=256)
    session = Session(search_settings)
    session.model = MemoryModel(search_settings.model_info, search_settings.setup, GiB)
    for exp in (session.experiment(0, 8, 8), session.experiment(0, 32, 2, ("activation_checkpointing",))):
        session.measured[exp.name] = (exp, TALL.run(exp))
    assert [o.micro_batch_size for o in session.observations()[0]] == [8]
    assert [exp.micro_batch_size for exp, _ in session.stage_records(0)] == [8]


def test_a_profile_run_out_of_memory_is_run_again_with_the_allowed_offload() -> None:
    experiments, records = run(BIG, settings(BIG, ["offload_optimizer", "activation_checkpointing"], profile=True))
    assert [exp.name for exp in experiments[:2]] == [PROFILE, f"{PROFILE}_oo"]
    assert records[PROFILE]["status"] == "oom" and records[f"{PROFILE}_oo"]["status"] == "ok"
    assert len(experiments) > 2 and all("offload_optimizer" in exp.strategy for exp in experiments[2:])
    with pytest.raises(SearchAborted, match="ran out of memory"):
        run(BIG, settings(BIG, ["activation_checkpointing"], profile=True))


def test_after_the_profile_ran_out_of_memory_only_offload_is_chosen() -> None:
    # 3e9 parameters with 30 % more state bytes than the model counts: the model alone would call
    # ZeRO-3 without offload a fit, and checkpointing (the cheapest strategy) too
    law = Law(num_params=3_000_000_000, activation=200_000_000, factor=1.3)
    experiments, records = run(law, settings(law, ["offload_optimizer", "activation_checkpointing"], profile=True))
    searched = [exp for exp in experiments if exp.space != PROFILE]
    assert searched and all("offload_optimizer" in exp.strategy for exp in searched)
    assert any(record["status"] == "ok" for name, record in records.items() if not name.startswith(PROFILE))


def _checkpointed_sizes(law: Law) -> list[tuple[int, str]]:
    """The checkpointed runs of the first stage strategies were tried at (the lead stage, ZeRO-1)."""
    experiments, records = run(law, settings(law, ["activation_checkpointing"], kept=480))
    tried = [exp for exp in experiments if exp.strategy and "_r" not in exp.name]
    return [(exp.micro_batch_size, records[exp.name]["status"]) for exp in tried if exp.stage == tried[0].stage]


def test_a_strategy_run_out_of_memory_is_followed_by_the_middle_size(monkeypatch: pytest.MonkeyPatch) -> None:
    law = Law(num_params=100_000_000, activation=1_500_000_000, keep=0.6)  # the prior share (0.3) over-promises
    monkeypatch.setattr(strategy_search, "CAUTIOUS_SPAN", 100.0)  # the line's top first, whatever its span
    # 15: the largest size of the kept step (120 a rank) below sqrt(8 x 30)
    assert _checkpointed_sizes(law) == [(30, "oom"), (15, "ok")]


def test_a_strategy_top_far_past_the_room_is_approached_by_its_middle_first() -> None:
    """The line's top (30) is nearly four times the leader's size at its memory top (8): mostly the
    prior's keep share, so its geometric middle (15 of the kept step) runs first, and the keep share
    that run measures (0.6) puts the line's top below TOP_GAIN x 15: no run out of memory at all."""
    law = Law(num_params=100_000_000, activation=1_500_000_000, keep=0.6)
    assert _checkpointed_sizes(law) == [(15, "ok")]


def test_a_strategy_whose_time_prior_exceeds_the_leaders_step_is_not_measured() -> None:
    """The leader at its memory top accumulates 4 micro-steps and reads 0.2 s per step; Adam on the CPU
    over its 2.5e8-parameter shard with the PCIe traffic takes about 0.33 s (strategies.CPU_ADAM_PARAMS_PER_S,
    PCIE_BYTES_PER_S), so optimizer offload cannot win at its samples per step; checkpointing adds a
    third of the compute at most: measured."""
    search_settings = settings(Law(1_000_000_000, 1_000_000_000), ["offload_optimizer", "activation_checkpointing"])
    session = Session(search_settings)
    session.model = MemoryModel(search_settings.model_info, search_settings.setup, GiB)
    leader = session.experiment(1, 8, 4)
    samples = 8 * 4 * 4
    session.measured[leader.name] = (leader, {"name": leader.name, "status": "ok", "ds_config": leader.ds_config,
                                              "metrics": {"throughput": samples / 0.2}})
    session.measured["z1_gas1_tmbspg9"] = (session.experiment(1, 9, 1), {"name": "z1_gas1_tmbspg9", "status": "oom"})
    phases = []
    search = try_strategies(session)
    try:
        phase = next(search)
        while True:
            phases.append(phase)
            phase = search.send({exp.name: {"name": exp.name, "status": "oom"} for exp in phase.experiments})
    except StopIteration:
        pass
    strategies = {exp.strategy for phase in phases for exp in phase.experiments}
    assert strategies == {("activation_checkpointing",)}


def test_a_strategys_probes_bisect_between_what_ran_and_what_ran_out_of_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without measured peaks the prior share (0.3) stays the line's: its top, 30 (run first here,
    whatever its span), runs out of memory (the real share is 0.6), then sqrt(9 x 30) = 16 does too,
    then sqrt(9 x 16) = 12 runs, and the fourth probe splits what is left: sqrt(12 x 16) = 14 runs.
    Those four are the lead stage's (ZeRO-1), tried from its top before its refinement; tried again
    from the final leader (the same stage's 9), the one size left between 14 and 16 runs: 15."""
    monkeypatch.setattr(strategy_search, "CAUTIOUS_SPAN", 100.0)
    law = Law(num_params=100_000_000, activation=1_500_000_000, keep=0.6, peaks=False)
    experiments, records = run(law, settings(law, ["activation_checkpointing"]))
    checkpointed = [(exp.micro_batch_size, records[exp.name]["status"]) for exp in experiments
                    if exp.strategy and "_r" not in exp.name]
    assert checkpointed == [(30, "oom"), (16, "oom"), (12, "ok"), (14, "ok"), (15, "ok")]


def test_a_kept_batch_that_nothing_holds_after_an_offloaded_profile_is_refused_in_one_line() -> None:
    law = Law(num_params=4_000_000_000, activation=200_000_000, backward=16 * GiB)  # no step fits anywhere
    with pytest.raises(SearchAborted, match="no config keeping the global batch of 8") as caught:
        run(law, settings(law, ["offload_optimizer"], kept=8, profile=True))
    assert "\n" not in str(caught.value)


def test_strategies_stack_while_each_pays_at_its_own_memory_top() -> None:
    """Checkpointing lifts the leader's ZeRO-3 top and reads better; its own line is full there, so
    the optimizer's offload is tried on top of it (it frees the states checkpointing does not)."""
    law = Law(num_params=700_000_000, activation=1_000_000_000)
    experiments, records = run(law, settings(law, ["offload_optimizer", "activation_checkpointing"]))
    tried = [(exp.strategy, records[exp.name]["status"]) for exp in experiments if exp.strategy and "_r" not in exp.name]
    first_stacked = next(i for i, (strategy, _) in enumerate(tried) if len(strategy) == 2)
    assert (("activation_checkpointing",), "ok") in tried[:first_stacked]
    assert tried[first_stacked] == (("offload_optimizer", "activation_checkpointing"), "ok")


def _strategies_tried(law: Law, allowed: list[str]) -> list[tuple[tuple[str, ...], str]]:
    experiments, records = run(law, settings(law, allowed))
    return [(exp.strategy, records[exp.name]["status"]) for exp in experiments if exp.strategy and "_r" not in exp.name]


def test_the_strategy_freeing_the_most_goes_first_and_once_it_pays_the_rest_only_stack_on_it() -> None:
    """Checkpointing's line holds the larger size at ZeRO-3 and its run there pays, so the optimizer's
    offload, which frees less, is never measured alone: only on top of checkpointing."""
    tried = _strategies_tried(Law(num_params=700_000_000, activation=1_000_000_000),
                              ["offload_optimizer", "activation_checkpointing"])
    assert tried[0] == (("activation_checkpointing",), "ok")
    assert (("offload_optimizer", "activation_checkpointing"), "ok") in tried
    assert all(strategy != ("offload_optimizer",) for strategy, _ in tried)


def test_a_strategy_that_does_not_pay_leaves_the_next_to_be_tried_alone() -> None:
    """Past 6 samples a sample costs more, so checkpointing's larger sizes read worse than the leader:
    the optimizer's offload is then measured on its own."""
    tried = _strategies_tried(Law(num_params=700_000_000, activation=1_000_000_000, peak=6),
                              ["offload_optimizer", "activation_checkpointing"])
    assert tried[0][0] == ("activation_checkpointing",)
    assert (("offload_optimizer",), "ok") in tried


def test_a_strategy_is_not_ruled_out_by_its_time_prior_at_one_micro_step_per_step() -> None:
    """At one micro-step per step and no kept batch a larger micro-batch also spreads the step's fixed
    costs over more samples, so no time prior says a strategy cannot win."""
    search_settings = settings(Law(1_000_000_000, 1_000_000_000), ["offload_optimizer"])
    session = Session(search_settings)
    session.model = MemoryModel(search_settings.model_info, search_settings.setup, GiB)
    leader = session.experiment(1, 8, 1)
    record = {"name": leader.name, "status": "ok", "metrics": {"throughput": 8 * 4 / 0.2}}
    assert not strategy_search._too_slow(session, leader, record, "offload_optimizer")
    accumulating = session.experiment(1, 8, 4)
    record = {"name": accumulating.name, "status": "ok", "metrics": {"throughput": 8 * 4 * 4 / 0.2}}
    assert strategy_search._too_slow(session, accumulating, record, "offload_optimizer")


def test_a_strategy_that_pays_at_its_lines_top_measures_the_safety_margin_too() -> None:
    """Checkpointing's run at its line's top (95 % of the budget) reads better than the leader, so the
    sizes the safety margin kept out (up to the line's own top) are measured once: 36, then 38."""
    law = Law(num_params=100_000_000, activation=1_500_000_000, keep=0.25)
    experiments, records = run(law, settings(law, ["activation_checkpointing"]))
    sizes = [(exp.micro_batch_size, records[exp.name]["status"]) for exp in experiments
             if exp.strategy and "_r" not in exp.name]
    assert sizes == [(16, "ok"), (36, "ok"), (38, "ok")]


def test_only_a_reading_better_than_the_leaders_best_pays() -> None:
    search_settings = settings(TALL, ["activation_checkpointing"])
    session = Session(search_settings)
    leader = session.experiment(0, 8, 1)
    for name, value in ((leader.name, 100.0), (f"{leader.name}_r2", 120.0)):
        session.measured[name] = (leader, {"name": name, "status": "ok", "metrics": {"throughput": value}})
    checkpointed = {"name": "c", "status": "ok", "metrics": {"throughput": 110.0}}
    assert not strategy_search._beats(session, checkpointed, leader)
    assert strategy_search._beats(session, {**checkpointed, "metrics": {"throughput": 121.0}}, leader)


def test_a_strategys_top_is_read_off_a_line_no_steeper_than_the_failures_prove() -> None:
    """The profile reports 30 % of the real activations and no run reports its peak, so the
    analytical line promises about three times the sizes that fit: the sampled search's own runs
    out of memory (9 at its stage) prove the line steeper, and the checkpointing line read off the
    steeper one holds its first probes (off the profile's: 100, then 55, out of memory), and its
    largest run holds at least what the profile's line reached. No peak checks the keep share
    (the prior's 0.3), so past the line's top the search brackets the top: one size larger, then
    the middle, out of memory twice at most."""
    law = Law(num_params=100_000_000, activation=1_500_000_000, keep=0.3, peaks=False)
    understated = ModelInfo(law.num_params, law.num_params, int(law.activation * 0.3))
    experiments, records = run(law, replace(settings(law, ["activation_checkpointing"]), model_info=understated))
    checkpointed = [(exp.micro_batch_size, records[exp.name]["status"]) for exp in experiments
                    if exp.strategy and "_r" not in exp.name]
    assert [status for _, status in checkpointed[:2]] == ["ok", "ok"], checkpointed
    assert sum(status == "oom" for _, status in checkpointed) <= 2, checkpointed
    assert max(size for size, status in checkpointed if status == "ok") >= 30, checkpointed


def test_a_strategy_that_paid_is_measured_once_at_the_stage_with_more_room_for_it() -> None:
    """The leader sits at ZeRO-0's memory top (4) and checkpointing pays there (7, then 14): ZeRO-1
    shards the optimizer's 12 bytes per parameter, so its checkpointed line holds a size above
    TOP_GAIN x 14, measured once at its top (15). ZeRO-1 itself ran 4, the size ZeRO-0 holds."""
    law = Law(num_params=100_000_000, activation=3_000_000_000, keep=0.3)
    readings = {size: law.run(Experiment("x", 0, size, 1, {}))["metrics"]["throughput"] for size in (1, 2, 4)}
    assert _strategies_from(readings, law, {1: 4}) == [(0, 7, 1), (0, 14, 1), (1, 15, 1)]


@dataclass(frozen=True)
class Straggler(Law):
    """`Law`, but the first reading of checkpointing's run at `slow_size` is a straggler's (half)."""

    slow_size: int = 0

    def run(self, exp: Experiment) -> dict[str, Any]:
        record = super().run(exp)
        if exp.strategy and exp.micro_batch_size == self.slow_size and not exp.name.endswith("_r2") and "metrics" in record:
            record["metrics"] = {"throughput": record["metrics"]["throughput"] / 2}
        return record


def test_a_larger_strategy_run_reading_below_a_smaller_one_is_read_again() -> None:
    """Checkpointing runs 16, then 32 (the step's samples held, fewer micro-steps): 32's first reading
    is a straggler's, half its own, below 16's. The line says a larger size cannot be that much
    slower, so it is read again at once, inside the strategy's probes (before confirmation); an
    honest reading is not."""
    def phases(law: Law) -> list[str]:
        names: list[str] = []

        def run_phase(phase) -> dict[str, dict]:
            names.append(phase.name)
            return {exp.name: law.run(exp) for exp in phase.experiments}

        drive(fast_search(settings(law, ["activation_checkpointing"], kept=256)), run_phase)
        return names

    straggling = phases(Straggler(**{**TALL.__dict__, "slow_size": 32}))
    assert straggling[straggling.index("z1_strategy_ac_32") + 1] == "z1_strategy_ac_32_recheck", straggling
    assert "z1_strategy_ac_32_recheck" not in phases(TALL)



#: 1e8 parameters, 375 MB of activations per sample: ZeRO-0 tops out at 35.
ROOMY = Law(num_params=100_000_000, activation=375_000_000)


def _strategies_from(readings: dict[int, float], law: Law = ROOMY,
                     others: dict[int, int] | None = None) -> list[tuple[int, int, int]]:
    """(stage, micro-batch, accumulation) of the runs `try_strategies` measures after ZeRO-0 read
    `readings` (size -> throughput), each size at its accumulation in the space, and each stage of
    `others` (stage -> size) ran its size; a size read again reads the same."""
    search_settings = settings(law, ["activation_checkpointing"])
    session = Session(search_settings)
    session.model = MemoryModel(search_settings.model_info, search_settings.setup, GiB)
    for mbs, value in readings.items():
        exp = session.experiment(0, mbs, gas_for(session, 0, mbs))
        session.measured[exp.name] = (exp, {**law.run(exp), "metrics": {"throughput": value}})
    for stage, mbs in (others or {}).items():
        exp = session.experiment(stage, mbs, gas_for(session, stage, mbs))
        session.measured[exp.name] = (exp, law.run(exp))
    measured: list[tuple[int, int, int]] = []

    def run_phase(phase) -> dict[str, dict]:
        measured.extend((exp.stage, exp.micro_batch_size, exp.gradient_accumulation_steps) for exp in phase.experiments)
        return {exp.name: {**law.run(exp), "metrics": {"throughput": readings[exp.micro_batch_size]}}
                if exp.name.endswith("_r2") else law.run(exp) for exp in phase.experiments}

    drive(try_strategies(session), run_phase)
    return measured


def test_a_lucky_reading_below_a_flat_top_does_not_keep_strategies_out() -> None:
    """ZeRO-0 ran up to 32 and reads the same at every size, but for a lucky reading at 10 that
    makes 10 the leader, below its stage's top. The cost model fitted to the stage's readings
    predicts the top within the noise of its best size: the curve is flat to the memory top, so
    checkpointing is measured from the top's run (a larger size, the step kept). A curve that
    turns down before the top keeps them out: a larger size would read worse."""
    first = _strategies_from({4: 100.0, 8: 101.0, 10: 130.0, 16: 99.0, 32: 100.0})[0]
    assert first[0] == 0 and first[1] > 32
    assert _strategies_from({4: 80.0, 8: 110.0, 10: 125.0, 16: 120.0, 32: 70.0}) == []


def test_a_strategy_that_paid_is_measured_once_at_a_stage_never_measured_with_more_room() -> None:
    """Only ZeRO-0 was measured (its curve rising to its top, 27); checkpointing pays there. The
    other stages were never measured (a search leaves ZeRO-3 out below 4 data-parallel ranks), but
    the memory model shards 3e8 parameters' states there: ZeRO-3's checkpointed line holds the most,
    so the best checkpointed run is measured there once, at the size its line holds."""
    runs = _strategies_from({4: 60.0, 9: 80.0, 13: 90.0, 27: 100.0}, Law(num_params=300_000_000, activation=375_000_000))
    assert {stage for stage, _, _ in runs[:-1]} == {0} and runs[-1][0] == 3
    assert runs[-1][1] > max(mbs for _, mbs, _ in runs[:-1])


def test_a_checkpointed_line_no_peak_checked_is_followed_past_its_top_until_a_size_fails() -> None:
    """6 GB of activations per sample: every stage holds 2 without a strategy. Without measured peaks
    the checkpointed line is the prior's (a keep share of 0.3 where the script keeps 0.25), so its
    top at ZeRO-0 (7) is short of what fits (8). Its runs pay, and only a failure bounds such a line:
    past its top a size UNBOUNDED_STEP larger is measured (9: it does not fit), then the middle
    between what ran and what failed (8, the true top). (ZeRO-1, the lead stage, tried first, holds
    9 and fails at 12; that failure is no peak, but ends the line's span being the prior's: ZeRO-0
    starts at its top.) With peaks the measured keep share reads the true top off the line: nothing
    fails."""
    def checkpointed(peaks: bool, stages: tuple[int, ...]) -> list[tuple[int, str]]:
        law = Law(num_params=100_000_000, activation=6_000_000_000, peaks=peaks)
        experiments, records = run(law, settings(law, ["activation_checkpointing"]))
        return [(exp.micro_batch_size, records[exp.name]["status"]) for exp in experiments
                if exp.strategy and "_r" not in exp.name and exp.stage in stages]
    unchecked, checked = checkpointed(False, (0,)), checkpointed(True, (0, 1, 2, 3))
    assert unchecked == [(7, "ok"), (9, "oom"), (8, "ok")], unchecked
    assert [status for _, status in checked] == ["ok"] * len(checked) and max(checked)[0] >= 8, checked


def test_only_a_checkpointed_line_no_peak_checked_is_bracketed_past_its_top() -> None:
    """Without peaks, a run at its line's top that paid: the checkpointed line rests on the prior's
    keep share, so the next size is UNBOUNDED_STEP larger; offload frees the states' bytes the model
    counts exactly, so its line's top stands and the next size is only its safety margin's."""
    law = Law(num_params=400_000_000, activation=375_000_000, peaks=False)
    search_settings = settings(law, ["offload_optimizer", "activation_checkpointing"])
    session = Session(search_settings)
    session.model = MemoryModel(search_settings.model_info, search_settings.setup, GiB)
    leader = session.experiment(1, 8, 1)
    session.measured[leader.name] = (leader, {**law.run(leader), "metrics": {"throughput": 100.0}})
    following = {}
    for strategy in (("offload_optimizer",), ("activation_checkpointing",)):
        top = strategy_search._size(session, leader, strategy)
        exp = session.experiment(1, top, 1, strategy)
        session.measured[exp.name] = (exp, {**law.run(exp), "metrics": {"throughput": 200.0}})  # it paid
        margin = strategy_search._size(session, leader, strategy, safety=1.0)
        following[strategy[0]] = (top, margin, strategy_search._next_size(session, leader, strategy,
                                                                          session.measured[exp.name][1], top, None))
    top, margin, after = following["offload_optimizer"]
    assert after == margin < math.ceil(strategy_search.UNBOUNDED_STEP * top), following
    top, margin, after = following["activation_checkpointing"]
    assert after == math.ceil(strategy_search.UNBOUNDED_STEP * top) > margin, following


def test_the_roomier_stage_is_judged_on_lines_at_one_safety_margin() -> None:
    """ZeRO-0 and ZeRO-1 allowed. ZeRO-0's checkpointed run paid at 28, its line's top without the
    safety margin (26 with it). ZeRO-1's checkpointed line holds 29 with the margin: more room than ZeRO-0's 26 at the same
    margin (by TOP_GAIN), so the run is measured there once, though 29 is not TOP_GAIN past 28."""
    law = Law(num_params=150_000_000, activation=1_500_000_000, keep=0.3)
    search_settings = replace(settings(law, ["activation_checkpointing"]), stages=(0, 1))
    session = Session(search_settings)
    session.model = MemoryModel(search_settings.model_info, search_settings.setup, GiB)
    for stage in (0, 1):
        exp = session.experiment(stage, 8, gas_for(session, 0, 8))
        session.measured[exp.name] = (exp, law.run(exp))
    leader = session.experiment(0, 8, gas_for(session, 0, 8))
    checkpointing = ("activation_checkpointing",)
    assert (strategy_search._size(session, leader, checkpointing),
            strategy_search._size(session, leader, checkpointing, safety=1.0)) == (26, 28)
    paid = session.experiment(0, 28, 1, checkpointing)
    session.measured[paid.name] = (paid, law.run(paid))
    measured: list[tuple[int, int]] = []

    def run_phase(phase) -> dict[str, dict]:
        measured.extend((exp.stage, exp.micro_batch_size) for exp in phase.experiments)
        return {exp.name: law.run(exp) for exp in phase.experiments}

    drive(strategy_search._roomier_stage(session, leader, session.measured[leader.name][1]), run_phase)
    assert measured == [(1, 29)], measured


def bench_settings(surface) -> SearchSettings:
    """Our search's settings on a bench/search_quality.py script (its `ours`)."""
    return SearchSettings(
        ds_config=user_config(surface), capacity_bytes=surface.capacity, stages=(0, 1, 2, 3), num_gpus=surface.world,
        max_train_batch_size=surface.max_train_batch_size, peak_memory_key="peak_device_bytes", host_memory=False,
        memory_strategies=MemoryStrategyKeys(allowed=strategy_of(surface.allowed)))


def _bench_phases(seed: int) -> list[str]:
    """The phase names of our search on bench/search_quality.py's needs-strategy script `seed`."""
    surface = make_surface("needs-strategy", seed)
    phases: list[str] = []

    def run_phase(phase):
        phases.append(phase.name)
        return {exp.name: surface.run(exp.name, exp.ds_config, profile=exp.space == PROFILE)
                for exp in phase.experiments}

    drive(fast_search(bench_settings(surface)), run_phase)
    return phases


def test_offload_of_the_parameters_stacks_on_a_lower_stages_leader_at_zero_3() -> None:
    """needs-strategy script 1052: ZeRO-1 with the optimizer offloaded leads at its memory top (43);
    offloading the parameters too frees what holds it there, but applies only at ZeRO-3. Measured
    there once, at the size its line holds (88): a config within 1 % of the optimum. Which config is
    named then rests on the confirmation's readings of a heavy-tailed script, not on this rule."""
    phases = _bench_phases(1052)
    assert "z3_strategy_oo_op_88" in phases
    surface = make_surface("needs-strategy", 1052)
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    assert surface.throughput(3, 88, 1, zero, False) > 0.99 * surface.optimum()[0]


def test_strategies_stack_on_the_roomier_stages_run_when_it_leads() -> None:
    """needs-strategy script 1007: checkpointing pays at the lead stage, ZeRO-1 (109, tried from its
    top), and again at ZeRO-3, which holds more with it (169, the roomier stage). Offloading the
    parameters on top of that run holds 197, then 211, 0.99 of the optimum; without stacking on the
    roomier stage's run, 0.94."""
    phases = _bench_phases(1007)
    roomier = phases.index("z3_strategy_oo_ac_169")
    assert "z3_strategy_oo_op_ac_211" in phases[roomier:]
    assert ours(make_surface("needs-strategy", 1007)).fraction > 0.97


def test_the_searchs_own_optimizer_offload_is_swapped_for_parameter_offload_at_zero_3_once() -> None:
    """needs-strategy script 1017: nothing fits without offload, so the optimizer is offloaded in
    every run, and the best is ZeRO-2's 32 (the cap) at 0.77 of the optimum: ZeRO-3 with the
    parameters offloaded and checkpointing, the optimizer on the device. The priors put CPU Adam
    above fetching the parameters and recomputing, and ZeRO-3's line holds 32 that way: measured
    once, it is named. A search whose own strategy offloads nothing swaps nothing (script 1018)."""
    phases = _bench_phases(1017)
    assert phases.count("z3_swap_op_ac_32") == 1
    assert ours(make_surface("needs-strategy", 1017)).fraction > 0.99
    assert not [name for name in _bench_phases(1018) if "_swap_" in name]
