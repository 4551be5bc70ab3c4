"""The bench's synthetic scripts (bench/surfaces.py): the space DeepSpeed searches, the noise model
and the classic surfaces, with expected values worked out by hand."""
from __future__ import annotations

import dataclasses

from bench.surfaces import GiB, MBS_CAP, Surface, classic, make_surface, user_config


def tiny(**changes) -> Surface:
    """One stage that fits exactly 6 samples (states 0, overhead 0, 1 GiB per sample, 6 GiB device)."""
    base = Surface(family="monotone", seed=1, capacity=6 * GiB, num_params=0, state_factor=1.0, activation=GiB,
                   profile_activation_fraction=1.0, alloc_overhead=0, untracked=0, sample_time=1e-3,
                   micro_overhead=1e-3, optimizer_time=0.0, comm_time=0.0, stage_comm=(1, 1, 1, 1),
                   stage3_gather=0.0, peak=None, fall_off=0.0, pressure_threshold=1.0, pressure_penalty=0.0,
                   overlap_gain=0.0, contiguous_gain=0.0, max_train_batch_size=None)
    return dataclasses.replace(base, **changes)


def test_without_a_limit_the_space_is_each_stages_top_times_the_users_gas() -> None:
    surface = tiny()
    assert surface.max_fit(0) == 6
    # gas 1 for every size, and gas 6 // m: (1, 6), (2, 3), (3, 2), (4, 1), (5, 1), (6, 1)
    assert surface.space(0) == [(1, 1), (1, 6), (2, 1), (2, 3), (3, 1), (3, 2), (4, 1), (5, 1), (6, 1)]
    assert "max_train_batch_size" not in user_config(surface)["autotuning"]


def test_with_a_limit_every_size_fills_the_limit() -> None:
    surface = tiny(max_train_batch_size=16)  # 8 samples per GPU per step on 2 ranks; 6 fit
    assert surface.space(0) == [(1, 8), (2, 4), (3, 2), (4, 2), (5, 1), (6, 1)]
    assert user_config(surface)["autotuning"]["max_train_batch_size"] == 16


def test_the_optimum_is_the_best_of_the_space() -> None:
    for family, seed in (("mid-peak", 3), ("large-model", 8), ("cliff", 11)):
        surface = make_surface(family, seed)
        brute = max((surface.throughput(s, m, g), (s, m, g)) for s in range(4) for m, g in surface.space(s))
        assert surface.optimum() == brute
        assert all(m <= min(MBS_CAP, surface.max_fit(s)) for s in range(4) for m, _ in surface.space(s))


def test_stragglers_slow_or_speed_a_reading_within_the_stated_ranges() -> None:
    noiseless = tiny(noise=0.0, straggler_rate=0.3)
    factors = [noiseless.reading_factor(f"z0_gas1_tmbspg1_r{i}", 0, 1, 1) for i in range(2000)]
    slow = [f for f in factors if f < 1]
    fast = [f for f in factors if f > 1]
    assert all(1 / 2.0 <= f <= 1 / 1.5 for f in slow) and all(1.3 <= f <= 1.8 for f in fast)
    assert 0.25 < len(slow) / len(factors) < 0.35 and 0.07 < len(fast) / len(factors) < 0.13
    assert len(factors) - len(slow) - len(fast) == sum(f == 1 for f in factors)
    # the same name draws the same reading; another name its own
    assert noiseless.reading_factor("a", 0, 1, 1) == noiseless.reading_factor("a", 0, 1, 1)


def test_per_config_noise_differs_between_configs_within_the_spread() -> None:
    surface = tiny(noise=0.02, noise_spread=4.0)
    spreads = {surface.config_noise(0, m, g) for m, g in surface.space(0)}
    assert len(spreads) == len(surface.space(0)) and all(0.01 <= v <= 0.08 for v in spreads)
    assert tiny(noise=0.02).config_noise(0, 3, 2) == 0.02


def test_classic_surfaces_are_the_ones_drawn_before() -> None:
    """Values recorded from the bench's surfaces before the new attributes were added (commit 36b6801):
    the earlier figures in bench/README.md were measured on exactly these."""
    recorded = {("cliff", 3): (512, 35331513, 16 * GiB), ("mid-peak", 20): (128, 322985520, 16 * GiB),
                ("large-model", 7): (256, 188967654, 80 * GiB)}
    for (family, seed), (limit, activation, capacity) in recorded.items():
        surface = classic(make_surface(family, seed))
        assert (surface.max_train_batch_size, surface.activation, surface.capacity) == (limit, activation, capacity)
        assert surface.noise_spread == 0 and surface.straggler_rate == 0
