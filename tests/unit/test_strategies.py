"""The pure side of memory strategies (`scheduler.search.strategies`): what is allowed, what each
frees in the memory model, the keep share a checkpointed run measures, and the time priors."""
from __future__ import annotations

import pytest

from scheduler.inputs.memory_strategies import MemoryStrategyKeys
from scheduler.search.memory import MemoryModel, ModelInfo, TrainingSetup
from scheduler.search.strategies import (
    CHECKPOINT_KEEP_PRIOR, CPU_ADAM_PARAMS_PER_S, PCIE_BYTES_PER_S, StepFacts, allow_line, applies,
    fixed_by_user, freed_bytes, measured_keep_share, ordered_combinations, searchable, step_cost_s, strategy_model,
)

ALL = ["offload_optimizer", "offload_param", "activation_checkpointing"]
INFO = ModelInfo(num_params=1_000_000_000, trainable_num_params=1_000_000_000, activation_mem_per_gpu=100_000_000)
MODEL = MemoryModel(INFO, TrainingSetup(world_size=4, mixed_precision=True), overhead_bytes=0)


def config(**zero) -> dict:
    return {"zero_optimization": {"stage": "all", **zero}, "autotuning": {}}


def test_searchable_leaves_out_what_the_user_fixed_and_cpu_offload_on_host_memory() -> None:
    allowed = MemoryStrategyKeys(allowed=tuple(ALL))
    assert searchable(allowed, config(), host_memory=False) == tuple(ALL)
    user_offload = config(offload_optimizer={"device": "cpu"}, offload_param={"device": "none"})
    assert fixed_by_user(user_offload) == ("offload_optimizer",)
    assert searchable(allowed, user_offload, host_memory=False) == ("offload_param", "activation_checkpointing")
    assert searchable(allowed, config(), host_memory=False, checkpointing_fixed=True) == ("offload_optimizer",
                                                                                          "offload_param")
    assert searchable(allowed, config(), host_memory=True) == ("activation_checkpointing",)
    nvme = MemoryStrategyKeys(allowed=tuple(ALL), nvme_path="/nvme")
    assert searchable(nvme, config(), host_memory=True) == tuple(ALL)
    assert searchable(MemoryStrategyKeys(), config(), host_memory=False) == ()
    assert searchable(MemoryStrategyKeys(), config(), host_memory=False, names=ALL[:1]) == ("offload_optimizer",)


def test_combinations_are_cheapest_first_and_stages_bound_them() -> None:
    combos = ordered_combinations(ALL)
    assert combos[:3] == [("activation_checkpointing",), ("offload_optimizer",), ("offload_param",)]
    assert combos[-1] == ("offload_optimizer", "offload_param", "activation_checkpointing") and len(combos) == 7
    assert applies(("activation_checkpointing",), 0) and not applies(("offload_optimizer",), 0)
    assert applies(("offload_optimizer",), 1) and not applies(("offload_param",), 2) and applies(("offload_param",), 3)


def test_strategies_free_what_they_move_in_the_memory_model() -> None:
    # ZeRO-1 on 4 ranks, bf16: params 2 GB, grads 2 GB, optimizer 12 GB / 4
    assert freed_bytes(MODEL, ("offload_optimizer",), 1) == 3_000_000_000
    assert freed_bytes(MODEL, ("offload_param",), 3) == 500_000_000
    assert freed_bytes(MODEL, ("activation_checkpointing",), 1) == 0
    checkpointed = strategy_model(MODEL, ("activation_checkpointing",))
    assert checkpointed.info.activation_mem_per_gpu == int(CHECKPOINT_KEEP_PRIOR * INFO.activation_mem_per_gpu)
    assert checkpointed.required_bytes(1, 10) == MODEL.required_bytes(1, 10) - 10 * (100_000_000 - 30_000_000)
    budget = MODEL.required_bytes(1, 1)
    assert MODEL.max_micro_batch_size(1, budget + 500_000_000) == 6
    assert strategy_model(MODEL, ("activation_checkpointing",), keep_share=0.5).max_micro_batch_size(
        1, budget + 500_000_000) == 12


@pytest.mark.parametrize(("peak", "fixed", "per_sample", "mbs", "share"), [
    (1_300, 1_000, 100, 10, 0.3),
    (900, 1_000, 100, 10, 0.05),  # below the fixed memory: clamped
    (5_000, 1_000, 100, 10, 1.0),
    (1_300, 1_000, 0, 10, None),
])
def test_measured_keep_share(peak: int, fixed: int, per_sample: int, mbs: int, share: float | None) -> None:
    assert measured_keep_share(peak, fixed, per_sample, mbs) == (pytest.approx(share) if share else share)


def test_time_priors() -> None:
    facts = StepFacts(compute_s=3.0, micro_steps=4, shard_params=250_000_000, rank_params=1_000_000_000)
    assert step_cost_s((), facts) == 0
    assert step_cost_s(("activation_checkpointing",), facts) == pytest.approx(1.0)
    optimizer = 250_000_000 / CPU_ADAM_PARAMS_PER_S + 2 * 2 * 250_000_000 / PCIE_BYTES_PER_S
    assert step_cost_s(("offload_optimizer",), facts) == pytest.approx(optimizer)
    assert step_cost_s(("offload_param",), facts) == pytest.approx(4 * 2 * 2 * 1_000_000_000 / PCIE_BYTES_PER_S)


def test_the_allow_line_names_the_checkpointing_flag_mapping() -> None:
    assert allow_line(("offload_optimizer",)) == '"autotuning": {"memory_strategies": ["offload_optimizer"]}'
    assert '"arg_mappings": {"activation_checkpointing"' in allow_line(("activation_checkpointing",))
