"""The bench's synthetic scripts (bench/surfaces.py): the space DeepSpeed searches, the noise model
and the classic surfaces, with expected values worked out by hand or recorded from the earlier code."""
from __future__ import annotations

import dataclasses

from bench.search_quality import every_config_once
from bench.surfaces import FAMILIES, GiB, MBS_CAP, Surface, classic, make_surface, user_config, with_buckets


def tiny(**changes) -> Surface:
    """Every stage fits exactly 6 samples (no states, no overhead, 1 GiB per sample, 6 GiB device)."""
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


#: Surfaces recorded from the bench before the new attributes were added (commit c7e83a5, whose
#: figures `--classic` reproduces): every field, one reading and the optimum.
RECORDED = {
    ("cliff", 3): dict(
        family="cliff", seed=3, capacity=17179869184, num_params=344557973, state_factor=1.000451328715458,
        activation=35331513, profile_activation_fraction=0.8575219485325155, alloc_overhead=1075409807,
        untracked=1110480068, sample_time=0.001, micro_overhead=0.002650654551152114,
        optimizer_time=0.025376329113526032, comm_time=0.0491101242650999,
        stage_comm=(1.0, 1.0180339467305783, 1.276712263234042, 1.276712263234042),
        stage3_gather=0.0241406599804475, peak=None, fall_off=0.0, pressure_threshold=0.8302835318638785,
        pressure_penalty=0.21323415591660427, overlap_gain=0.5148107548926526,
        contiguous_gain=0.027809450345929715, max_train_batch_size=512, failure_status="oom",
        reports_peak=True, noise=0.02, world=2),
    ("large-model", 7): dict(
        family="large-model", seed=7, capacity=85899345920, num_params=4855743200,
        state_factor=1.1800015224264115, activation=188967654, profile_activation_fraction=0.4514205907966321,
        alloc_overhead=250558872, untracked=2073572832, sample_time=0.001, micro_overhead=0.04262726978335708,
        optimizer_time=0.014597654516541715, comm_time=0.014491177187134881,
        stage_comm=(1.0, 1.107073161819192, 1.2773420344810253, 1.5367030061751195),
        stage3_gather=0.0019415092382473718, peak=None, fall_off=0.0, pressure_threshold=0.941599716156425,
        pressure_penalty=0.006402591326518825, overlap_gain=0.5844372997113797,
        contiguous_gain=0.004577981321228389, max_train_batch_size=256, failure_status="crashed",
        reports_peak=False, noise=0.02, world=2),
}
#: (max_train_batch_size, activation, capacity, reports_peak, reading of z1_gas3_tmbspg2, its _r2, optimum)
RECORDED_SHORT = {
    ("cliff", 3): (512, 35331513, 16 * GiB, True, 152.69280126431764, 152.33545183754663,
                   (1580.3188703315743, (1, 128, 2))),
    ("mid-peak", 20): (128, 322985520, 16 * GiB, False, 479.11579720792156, 475.32076746687915,
                       (1262.379133927303, (1, 4, 16))),
    ("large-model", 7): (256, 188967654, 80 * GiB, False, 75.50622111418821, 76.60452454865857,
                         (1315.475990202488, (1, 128, 1))),
    ("small-model", 11): (2048, 16759114, 16 * GiB, True, 32.374117628687564, 32.98384071936991,
                          (1483.3745285305704, (1, 512, 2))),
    ("monotone", 0): (2048, 36178644, 16 * GiB, True, 75.88985678673882, 76.9370041329218,
                      (1751.6156184276324, (2, 341, 3))),
    ("mid-peak", 13): (64, 642712736, 24 * GiB, True, 205.57560222941532, 203.82610209916638,
                       (795.6369493534233, (2, 16, 2))),  # now: no limit, no peak, noisier, stragglers
}
NEW_FIELDS = ("drawn_max_train_batch_size", "drawn_reports_peak", "noise_spread", "straggler_rate", "knobs",
              "bucket_bytes", "allowed", "keep_share", "recompute", "cpu_slowdown", "pcie_time", "param_fetch_time")


def test_classic_surfaces_are_the_ones_drawn_before() -> None:
    """`--classic` replays exactly the surfaces and readings drawn at commit c7e83a5."""
    for key, fields in RECORDED.items():
        surface = classic(make_surface(*key))
        now = {f.name: getattr(surface, f.name) for f in dataclasses.fields(surface) if f.name not in NEW_FIELDS}
        assert now == fields
    config = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    for (family, seed), (limit, activation, capacity, peak, reading, repeat, optimum) in RECORDED_SHORT.items():
        surface = classic(make_surface(family, seed))
        assert (surface.max_train_batch_size, surface.activation, surface.capacity, surface.reports_peak) == (
            limit, activation, capacity, peak)
        assert surface.noise_spread == 0 and surface.straggler_rate == 0
        assert surface.run("z1_gas3_tmbspg2", config)["metrics"]["throughput"] == reading
        assert surface.run("z1_gas3_tmbspg2_r2", config)["metrics"]["throughput"] == repeat
        assert surface.optimum() == optimum


def test_the_new_attributes_leave_the_old_draws_alone() -> None:
    """large-model 7 lost its limit and cliff 3 gained stragglers; everything else is as drawn."""
    unbounded, straggling = make_surface("large-model", 7), make_surface("cliff", 3)
    assert unbounded.max_train_batch_size is None and unbounded.drawn_max_train_batch_size == 256
    assert straggling.straggler_rate > 0
    harder = make_surface("mid-peak", 13)  # every new attribute differs from its classic surface
    assert (harder.max_train_batch_size, harder.reports_peak, harder.noise_spread) == (None, False, 4.0)
    assert harder.straggler_rate > 0 and harder.drawn_reports_peak
    for surface in (unbounded, straggling):
        old = RECORDED[(surface.family, surface.seed)]
        assert all(getattr(surface, name) == value for name, value in old.items()
                   if name not in ("max_train_batch_size", "reports_peak"))


def test_the_shares_of_the_harder_surfaces() -> None:
    surfaces = [make_surface(family, seed) for family in FAMILIES for seed in range(60)]
    share = lambda hit: sum(map(hit, surfaces)) / len(surfaces)  # noqa: E731
    assert 0.4 < share(lambda s: s.max_train_batch_size is None) < 0.6
    assert 0.22 < share(lambda s: not s.reports_peak) < 0.38
    assert 0.4 < share(lambda s: s.noise_spread > 1) < 0.6
    assert 0.4 < share(lambda s: s.straggler_rate > 0) < 0.6
    assert all(0.05 <= s.straggler_rate <= 0.15 for s in surfaces if s.straggler_rate)
    assert all(s.drawn_reports_peak or not s.reports_peak for s in surfaces)  # only ever fewer peaks


def test_a_reading_is_the_true_throughput_times_its_draw() -> None:
    surface = tiny(noise=0.02, noise_spread=4.0, straggler_rate=0.15)
    config = {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    for name in ("z0_gas3_tmbspg2", "z0_gas3_tmbspg2_r2", "z0_gas3_tmbspg2_r3"):
        reading = surface.run(name, config)["metrics"]["throughput"]
        assert reading == surface.throughput(0, 2, 3) * surface.reading_factor(name, 0, 2, 3)


def test_all_once_measures_exactly_the_space() -> None:
    """4 stages alike (no states) x the 9 configs of the first test; noise-free it finds the optimum."""
    outcome = every_config_once(tiny(noise=0.0))
    assert (outcome.launches, outcome.failed, outcome.fraction) == (36, 0, 1.0)
    assert every_config_once(tiny(noise=0.0, max_train_batch_size=16)).launches == 4 * 6


def test_deepspeeds_bucket_is_held_from_zero_1_on() -> None:
    """with_buckets: 10^9 bytes more at ZeRO-1/2/3 at every size, nothing at ZeRO-0; the surface is
    otherwise the same, and a surface where no stage would fit any more keeps no bucket."""
    plain = make_surface("small-model", 4)
    bucketed = with_buckets(plain)
    assert plain.bucket_bytes == 0 and bucketed.bucket_bytes == 10**9
    for stage in range(4):
        grown = bucketed.reserved(stage, 3) - plain.reserved(stage, 3)
        assert abs(grown - (10**9 if stage else 0)) <= 2 * 2**20  # reserved rounds up to 2 MiB
    edge = dataclasses.replace(plain, capacity=plain.reserved(1, 3) + plain.untracked)  # ZeRO-1 at 3 just fits
    assert edge.fits(1, 3) and not with_buckets(edge).fits(1, 3)
    tight = dataclasses.replace(plain, capacity=plain.reserved(3, 1) + plain.untracked + 2**20)
    assert tight.max_fit(3) == 1 and with_buckets(tight) is tight
