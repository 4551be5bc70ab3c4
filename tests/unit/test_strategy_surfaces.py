"""Memory strategies on the bench's synthetic scripts (bench/surfaces.py): what offload and
checkpointing change in a run's memory and speed, and the needs-strategy family."""
from __future__ import annotations

import dataclasses

import pytest

from bench.surfaces import FAMILIES, GiB, STRATEGIES, Surface, make_surface, user_config
from scheduler.search.space import experiment_config


def tiny(**changes) -> Surface:
    """1e8 parameters (1.6 GB of states at ZeRO-0), 1 GiB per sample, a 6 GiB device."""
    base = Surface(family="needs-strategy", seed=1, capacity=6 * GiB, num_params=100_000_000, state_factor=1.0,
                   activation=GiB, profile_activation_fraction=1.0, alloc_overhead=0, untracked=0, sample_time=1e-3,
                   micro_overhead=1e-3, optimizer_time=0.1, comm_time=0.0, stage_comm=(1, 1, 1, 1),
                   stage3_gather=0.01, peak=None, fall_off=0.0, pressure_threshold=1.0, pressure_penalty=0.0,
                   overlap_gain=0.0, contiguous_gain=0.0, max_train_batch_size=None, allowed=STRATEGIES,
                   keep_share=0.25, recompute=0.3, cpu_slowdown=4.0, pcie_time=0.05, param_fetch_time=0.02)
    return dataclasses.replace(base, **changes)


def config(stage: int, mbs: int, strategy: tuple[str, ...] = ()) -> dict:
    return experiment_config(user_config(tiny()), stage, mbs, 1, 2, 1, 2, strategy)


def test_offload_and_checkpointing_change_memory_and_time_as_documented() -> None:
    surface = tiny()
    plain, ac = surface.run("a", config(1, 4)), surface.run("b", config(1, 4, ("activation_checkpointing",)))
    assert plain["peak_device_bytes"] - ac["peak_device_bytes"] == pytest.approx(4 * 0.75 * GiB, abs=2 << 20)
    micro = 1e-3 + 4e-3  # overhead + 4 samples
    step = micro + 0.1 / 2  # the Adam step over the shard (ZeRO-1, 2 ranks)
    assert surface.throughput(1, 4, 1) == pytest.approx(8 / step)
    assert surface.throughput(1, 4, 1, checkpointing=True) == pytest.approx(8 / (step + 0.3 * 4e-3))
    offload = {"offload_optimizer": {"device": "cpu"}}
    assert surface.throughput(1, 4, 1, offload) == pytest.approx(8 / (micro + 4.0 * 0.1 / 2 + 0.05))
    assert surface.states(1) - surface.states(1, ("offload_optimizer",)) == pytest.approx(12 * 1e8 / 2)
    assert surface.states(3) - surface.states(3, ("offload_param",)) == pytest.approx(2 * 1e8 / 2)
    assert surface.throughput(3, 4, 1, {"offload_param": {"device": "cpu"}}) == pytest.approx(
        8 / (micro + 0.01 + 0.02 + 0.1 / 2))
    assert surface.max_fit(0) == 4 and surface.max_fit(0, ("activation_checkpointing",)) == 18


def test_the_optimum_counts_the_allowed_strategies() -> None:
    surface = tiny(micro_overhead=0.05)  # fixed costs per micro-step favour a larger batch
    value, (stage, mbs, gas) = surface.optimum()
    assert mbs > max(surface.max_fit(s) for s in range(4))  # only checkpointing holds it
    assert dataclasses.replace(surface, allowed=()).optimum()[0] < value


def test_the_needs_strategy_family_allows_every_strategy_and_needs_one() -> None:
    surfaces = [make_surface("needs-strategy", seed) for seed in range(40)]
    assert all(user_config(s)["autotuning"]["memory_strategies"] == list(STRATEGIES) for s in surfaces)
    no_fit = [s for s in surfaces if not any(s.max_fit(stage) for stage in range(4))]
    assert 10 <= len(no_fit) <= 30 and all(s.optimum()[0] > 0 for s in no_fit)
    assert "needs-strategy" not in FAMILIES  # the other benches' default rows stay as they were
    assert not make_surface("monotone", 3).allowed and "memory_strategies" not in user_config(
        make_surface("monotone", 3))["autotuning"]
