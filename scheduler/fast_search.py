"""DeepSpeed's autotuning search as a generator of phases, with DeepSpeed's defects fixed: fast mode
(ZeRO stage x micro-batch size, gradient accumulation from max_train_batch_size) and, with
`"fast": false`, full mode (each stage's ZeRO knobs explored by a tuner after its fast search).

Why this shape: the search is DeepSpeed's own (section 1.8 of the reference notes), so results and
experiment names read the same, but it is written against `scheduler.phases.Search` so the caller can
run a phase's experiments concurrently and replay the search from stored records after a crash.

Fixed here, compared with DeepSpeed 0.19:
- the min probe and the max probes of a stage run together in one phase, not one after another;
- the memory estimate is calibrated from each probe's measured peak, and an OOM is an upper bound
  for the search, not an error, so later stages rarely probe a size that cannot fit;
- the binary search's upper end is the smallest size that failed, and a size measured before is
  judged by its own result (DeepSpeed moves up past an already-run size even when it failed);
- the fine-grained search reads each probe's own metrics (DeepSpeed re-reads another's file);
- an experiment measured once is reused, never run or counted again;
- the plateau and fine-grained gains follow the metric's direction, so latency is minimised;
- every config is the user's config pinned to one point: zero options and offload survive;
- without max_train_batch_size, mp_size no longer divides the per-GPU batch (gas could reach 0).
"""
from __future__ import annotations

import math
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler.config import TuningConfig, non_negative_int
from scheduler.full_space import full_experiments
from scheduler.errors import ConfigError, UsageError
from scheduler.memory import (
    GiB, SAFETY, MemoryModel, ModelInfo, Observation, StageFit, TrainingSetup, deepspeed_fp16,
    SharedFacts, deepspeed_max_micro_batch_size, deepspeed_stage_fits, overhead_from_profile,
    predict_max_micro_batch_size, prior_overhead_bytes, shared_facts, untracked_reserve_bytes,
)
from scheduler.phases import Phase, Search
from scheduler.ranking import best, metric_value
from scheduler.sampled_search import confirm, sampled_stages, stages_near_leader
from scheduler.space import PROFILE, Experiment, experiment_config, experiment_name
from scheduler.tuners import TUNER_TYPES, StopRule, Trial, make_tuner, plan

#: DeepSpeed's METRIC_PERCENT_DIFF_CONST: a larger batch must improve the metric by more than this.
PLATEAU = 0.05
#: The fine-grained search tries about this many sizes below the largest candidate.
FINE_STEPS = 3
ESTIMATORS = ("calibrated", "deepspeed")
#: autotuning.search: our sampled search (default) or DeepSpeed's algorithm, for side-by-side runs.
SEARCHES = ("sampled", "deepspeed")

Step = Generator[Phase, dict[str, dict], Any]


class SearchAborted(UsageError):
    """The search cannot go on (the profile run failed, an op cannot be built); the message says what
    to change."""


class NoStageFits(SearchAborted):
    """No allowed ZeRO stage fits micro-batch 1 in the slots' memory; `shortfall_bytes` says by how much."""

    def __init__(self, message: str, shortfall_bytes: int) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes


@dataclass(frozen=True)
class SearchSettings:
    """Everything the fast search reads; built by `from_config` from a TuningConfig and the slots."""

    ds_config: dict[str, Any] = field(compare=False, repr=False)  #: the user's config, never mutated
    capacity_bytes: int  #: the smallest memory among the slots one experiment reserves
    stages: tuple[int, ...] = (0,)
    metric: str = "throughput"
    maximize: bool = True
    start_profile_step: int = 3
    end_profile_step: int = 5
    gradient_accumulation_steps: int = 1
    first_micro_batch_size: int = 1  #: the user's int mbs: where the first explored stage starts
    micro_batch_sizes: tuple[int, ...] = ()  #: the user's list: run exactly these, no search
    min_micro_batch_size: int = 1
    max_micro_batch_size: int = 1024
    max_train_batch_size: int | None = None
    num_tuning_micro_batch_sizes: int = 3
    mp_size: int = 1
    model_info: ModelInfo | None = None  #: given by the user: no profile run
    num_nodes: int = 1
    num_gpus: int = 1
    host_memory: bool = False  #: CPU slots: the capacity is host RAM
    overhead_bytes: int | None = None  #: None: from the profile run's peak, else the prior
    measured_reserve_bytes: int | None = None  #: what the profile run's ranks held outside the allocator
    peak_memory_key: str = "peak_rss_bytes"  #: the record field holding the memory the capacity limits
    estimator: str = "calibrated"  #: or "deepspeed": DeepSpeed's estimate, to compare OOM probes
    search: str = "sampled"  #: or "deepspeed": DeepSpeed's probe-and-bisect algorithm
    fast: bool = True  #: False: after a stage's fast search, tune its ZeRO knobs (full mode)
    tuner_type: str = "gridsearch"
    tuner_num_trials: int = 50
    tuner_early_stopping: int = 5
    tuner_seed: int = 0  #: seeds the random and model-based tuners; part of the config, so replay matches
    concurrency: int = 1  #: experiments that can run at once (slots // ranks per experiment)
    tuning_config: TuningConfig | None = field(default=None, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus

    @property
    def dp_size(self) -> int:
        return max(1, self.world_size // self.mp_size)

    @property
    def micro_batch_cap(self) -> int:
        """max_train_micro_batch_size_per_gpu, lowered so one step stays within max_train_batch_size."""
        if self.max_train_batch_size:
            return max(1, min(self.max_micro_batch_size, self.max_train_batch_size // self.dp_size))
        return self.max_micro_batch_size

    @property
    def reserve_bytes(self) -> int:
        """Device memory no measured peak includes: the prior (memory.untracked_reserve_bytes), or
        what the profile run measured when that is more (`measured_reserve`)."""
        prior = untracked_reserve_bytes(self.capacity_bytes, self.host_memory)
        return max(prior, self.measured_reserve_bytes or 0)

    @property
    def budget_bytes(self) -> int:
        """What measured peaks may reach: the capacity less the untracked reserve."""
        return self.capacity_bytes - self.reserve_bytes

    @property
    def samples_per_step(self) -> int | None:
        """Samples per GPU per optimizer step allowed by max_train_batch_size (None: no limit)."""
        return max(1, self.max_train_batch_size // self.dp_size) if self.max_train_batch_size else None

    def gas_for(self, mbs: int) -> int:
        """The accumulation that keeps mbs * gas within max_train_batch_size (the user's gas without it)."""
        per_step = self.samples_per_step
        return max(1, per_step // mbs) if per_step else self.gradient_accumulation_steps

    @property
    def setup(self) -> TrainingSetup:
        return TrainingSetup.from_ds_config(self.ds_config, self.world_size, self.mp_size, self.host_memory)

    @classmethod
    def from_config(cls, cfg: TuningConfig, *, capacity_bytes: int, num_nodes: int, num_gpus: int,
                    device_kind: str = "gpu", estimator: str = "calibrated",
                    concurrency: int = 1) -> SearchSettings:
        """The fields a TuningConfig does not carry come from `autotuning`, with DeepSpeed's defaults."""
        if device_kind not in ("cpu", "gpu") or estimator not in ESTIMATORS:
            raise ValueError(f"device_kind {device_kind!r} or estimator {estimator!r} is not known")
        section = cfg.ds_config.get("autotuning") or {}
        min_mbs = _positive(cfg, section, "min_train_micro_batch_size_per_gpu", 1)
        max_mbs = _positive(cfg, section, "max_train_micro_batch_size_per_gpu", 1024)
        if min_mbs > max_mbs:
            raise ConfigError(f"{cfg.path}: autotuning.min_train_micro_batch_size_per_gpu ({min_mbs}) is above "
                              f"max_train_micro_batch_size_per_gpu ({max_mbs}); make min <= max")
        mp_size = _positive(cfg, section, "mp_size", 1)
        if (num_nodes * num_gpus) % mp_size:
            raise ConfigError(f"{cfg.path}: autotuning.mp_size ({mp_size}) must divide the GPUs of one "
                              f"experiment ({num_nodes * num_gpus})")
        listed = isinstance(cfg.ds_config.get("train_micro_batch_size_per_gpu"), list)
        return cls(
            ds_config=cfg.ds_config, capacity_bytes=capacity_bytes, stages=cfg.stages, metric=cfg.metric,
            maximize=cfg.maximize, start_profile_step=cfg.start_profile_step,
            end_profile_step=cfg.end_profile_step, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            first_micro_batch_size=cfg.micro_batch_sizes[0], micro_batch_sizes=cfg.micro_batch_sizes if listed else (),
            min_micro_batch_size=min_mbs, max_micro_batch_size=max_mbs,
            max_train_batch_size=_positive(cfg, section, "max_train_batch_size", None),
            num_tuning_micro_batch_sizes=_positive(cfg, section, "num_tuning_micro_batch_sizes", 3),
            mp_size=mp_size, model_info=ModelInfo.from_mapping(section.get("model_info")),
            num_nodes=num_nodes, num_gpus=num_gpus, host_memory=device_kind == "cpu",
            peak_memory_key="peak_rss_bytes" if device_kind == "cpu" else "peak_device_bytes", estimator=estimator,
            search=_search(cfg, section), fast=bool(section.get("fast", True)), tuner_type=_tuner_type(cfg, section),
            tuner_num_trials=_positive(cfg, section, "tuner_num_trials", 50),
            tuner_early_stopping=non_negative_int(cfg.path, section, "tuner_early_stopping", 5),
            tuner_seed=non_negative_int(cfg.path, section, "tuner_seed", 0), concurrency=max(1, concurrency),
            tuning_config=cfg,
        )


def _tuner_type(cfg: TuningConfig, section: Mapping[str, Any]) -> str:
    value = section.get("tuner_type", "gridsearch")
    if value not in TUNER_TYPES:
        raise ConfigError(f"{cfg.path}: autotuning.tuner_type {value!r} is not one of "
                          f"{', '.join(TUNER_TYPES)}")
    return value


def _search(cfg: TuningConfig, section: Mapping[str, Any]) -> str:
    value = section.get("search", "sampled")
    if value not in SEARCHES:
        raise ConfigError(f"{cfg.path}: autotuning.search {value!r} is not one of {', '.join(SEARCHES)}")
    return value


def _positive(cfg: TuningConfig, section: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = section.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{cfg.path}: autotuning.{key} must be a positive integer, got {value!r}")
    return value


# ---------------------------------------------------------------- DeepSpeed's list arithmetic


def max_probes(predicted: int, start: int, cap: int, smallest_failure: int | None = None) -> tuple[int, ...]:
    """ceil(1.05 m), m, int(0.95 m) for m = min(predicted, cap), largest first, keeping the sizes above
    `start`, within `cap` and below a size already known to fail."""
    m = min(predicted, cap)
    limit = cap if smallest_failure is None else min(cap, smallest_failure - 1)
    sizes: list[int] = []
    for size in (-(-105 * m // 100), m, 95 * m // 100):
        if start < size <= limit and size not in sizes:
            sizes.append(size)
    return tuple(sizes)


def max_train_batch_size_per_gpu(max_mbs: int, gas: int, dp_size: int, max_train_batch_size: int | None) -> int:
    """Samples per GPU per optimizer step shared by the candidates (DeepSpeed's mtbpg)."""
    if max_train_batch_size:
        return max(max_mbs, max_train_batch_size // dp_size)
    return max_mbs * max(1, gas)


def tuning_micro_batch_sizes(min_mbs: int, max_mbs: int, k: int, mtbpg: int) -> list[int]:
    """DeepSpeed's candidates: sizes from max/2 (or min) up to max in steps of (max-low)//k, keeping
    only those whose accumulation steps (mtbpg // size) differ from the largest size's, plus max."""
    if min_mbs <= 0 or max_mbs <= 0:
        return []
    low = max(min_mbs, max_mbs // 2)
    stride = (max_mbs - low) // k or 1
    min_gas = mtbpg // max_mbs
    return [m for m in range(low, max_mbs, stride) if mtbpg // m != min_gas] + [max_mbs]


def fine_grained_micro_batch_sizes(candidates: Sequence[int], min_mbs: int, max_mbs: int) -> list[int]:
    """Sizes just below the largest candidate, tried from the top down."""
    low = candidates[-2] + 1 if len(candidates) > 1 else min_mbs
    stride = (max_mbs - low) // FINE_STEPS or 1
    return list(reversed(range(low, max_mbs, stride)))


def gain(previous: float, current: float, maximize: bool) -> float:
    """Relative improvement from `previous` to `current` in the metric's direction (inf from 0)."""
    if not previous:
        return math.inf
    change = (current - previous) if maximize else (previous - current)
    return change / abs(previous)


# ---------------------------------------------------------------- the search


def fast_search(settings: SearchSettings) -> Search:
    """Profile (unless model_info is given), then per allowed stage 0..3: the memory gate, the min and
    max probes, the binary search, the candidate list and the fine-grained search. Raises
    `NoStageFits` or `SearchAborted` from `next`/`send` when the search cannot start."""
    session = _Session(settings)
    info, profile_peak = settings.model_info, None
    if info is None:
        info, profile_peak = yield from _profile(session)
        reserve = measured_reserve(session.measured[PROFILE][1], settings.host_memory)
        if reserve is not None:
            settings = session.settings = replace(settings, measured_reserve_bytes=reserve)
    overhead = settings.overhead_bytes
    if overhead is None:
        measured = overhead_from_profile(info, settings.setup, profile_peak)
        overhead = measured if measured is not None else \
            prior_overhead_bytes(settings.capacity_bytes, settings.host_memory) - settings.reserve_bytes
    session.model = MemoryModel(info, settings.setup, max(0, overhead))
    stages = _feasible_stages(session)
    if settings.micro_batch_sizes:
        for stage in stages:
            yield from _run_list(session, stage)
        return
    if settings.search == "sampled":
        yield from sampled_stages(session, stages)
        if not settings.fast:
            for stage, mbs, gas in stages_near_leader(session, stages):
                yield from tune_full_space(session, stage, [mbs], mbs * gas)
        yield from confirm(session)
        return
    carried_best = carried_max = 0
    carried_metric: float | None = None
    for stage in stages:
        best_mbs, max_mbs, candidates = yield from _tune_stage(session, stage, carried_max)
        stage_metric = session.metric(_best_name(session, stage))
        if not settings.fast and stage > 0 and candidates and best_mbs > carried_best \
                and not _worse(stage_metric, carried_metric, settings.maximize):
            yield from tune_full_space(session, stage, *candidates)
        if best_mbs > carried_best:
            carried_best, carried_max, carried_metric = best_mbs, max_mbs, stage_metric


class _Session:
    """The generator's memory: every experiment measured so far, in the order it was measured."""

    def __init__(self, settings: SearchSettings) -> None:
        self.settings = settings
        self.measured: dict[str, tuple[Experiment, dict[str, Any]]] = {}
        self.model: MemoryModel | None = None

    def measure(self, phase: str, experiments: Sequence[Experiment]) -> Step:
        """Yields the experiments not measured before as one phase; returns all their records in order."""
        fresh: dict[str, Experiment] = {}
        for exp in experiments:
            if exp.name not in self.measured:
                fresh.setdefault(exp.name, exp)
        if fresh:
            sent = (yield Phase(phase, tuple(fresh.values()))) or {}
            for name, exp in fresh.items():
                record = sent.get(name)
                self.measured[name] = (exp, record if isinstance(record, dict) else {"name": name, "status": "lost"})
            for name, exp in fresh.items():
                refuse_unbuildable_op(exp, self.measured[name][1])
        return [self.measured[exp.name][1] for exp in experiments]

    def experiment(self, stage: int, mbs: int, gas: int) -> Experiment:
        st = self.settings
        config = experiment_config(st.ds_config, stage, mbs, gas, st.dp_size, st.start_profile_step,
                                   st.end_profile_step)
        return Experiment(experiment_name(stage, gas, mbs), stage, mbs, gas, config, st.num_nodes, st.num_gpus)

    def profile_experiment(self) -> Experiment:
        st = self.settings
        config = experiment_config(st.ds_config, 3, 1, 1, st.dp_size, st.start_profile_step, st.end_profile_step)
        config["memory_breakdown"] = False
        config["autotuning"]["model_info"] = {"profile": True}
        return Experiment(PROFILE, 3, 1, 1, config, st.num_nodes, st.num_gpus, tuning_space=PROFILE,
                          metric_file="model_info.json")

    def stage_records(self, stage: int) -> list[tuple[Experiment, dict[str, Any]]]:
        return [(exp, rec) for exp, rec in self.measured.values() if exp.stage == stage and exp.name != PROFILE]

    def observations(self) -> dict[int, list[Observation]]:
        """Per stage: measured peaks of successes, and upper bounds: every `oom` (`too_large`) at a
        size larger than any the stage ran (an out-of-memory at or below a size that ran is the GPU's
        state, not the config's). A timeout, a lost node or a plain crash says nothing about memory
        and is no memory fact."""
        found: dict[int, list[Observation]] = {}
        for stage in sorted({exp.stage for exp, _ in self.measured.values()}):
            records = self.stage_records(stage)
            largest_ok = max((exp.micro_batch_size for exp, record in records if _ok(record)), default=0)
            for exp, record in records:
                if _ok(record):
                    peak = _peak(record, self.settings.peak_memory_key)
                    found.setdefault(stage, []).append(Observation(exp.micro_batch_size, peak))
                elif too_large(record) and exp.micro_batch_size > largest_ok:
                    found.setdefault(stage, []).append(Observation(exp.micro_batch_size, oom=True))
        return found

    @property
    def budget(self) -> int:
        return self.settings.budget_bytes

    def gate(self, stage: int) -> StageFit:
        st = self.settings
        if st.estimator == "deepspeed":
            return deepspeed_stage_fits(self.model.info, stage, deepspeed_fp16(st.ds_config), st.world_size,
                                        st.mp_size, st.capacity_bytes)
        return self.model.gate(stage, st.budget_bytes)

    def predicted_max(self, stage: int, safety: float = SAFETY) -> int:
        st = self.settings
        if st.estimator == "deepspeed":
            predicted = deepspeed_max_micro_batch_size(self.model.info, stage, deepspeed_fp16(st.ds_config),
                                                       st.world_size, st.mp_size, st.capacity_bytes)
        else:
            predicted = predict_max_micro_batch_size(self.model, stage, st.budget_bytes, self.observations(), safety)
        return min(predicted, st.micro_batch_cap)

    def shared_facts(self, stage: int) -> SharedFacts:
        """What the other stages' probes prove or predict about this stage's largest micro-batch."""
        if self.settings.estimator == "deepspeed":
            return SharedFacts()
        return shared_facts(self.model, stage, self.settings.budget_bytes, self.observations())

    def smallest_failure(self, stage: int) -> int | None:
        return min((exp.micro_batch_size for exp, rec in self.stage_records(stage) if not _ok(rec)), default=None)

    def metric(self, name: str) -> float | None:
        entry = self.measured.get(name)
        return metric_value(entry[1], self.settings.metric) if entry else None

    def best_mbs(self, stage: int) -> int:
        pairs = self.stage_records(stage)
        winner = best([rec for _, rec in pairs], self.settings.metric, self.settings.maximize)
        return next((exp.micro_batch_size for exp, rec in pairs if rec is winner), 0)


def _ok(record: Mapping[str, Any]) -> bool:
    return record.get("status") == "ok"


def too_large(record: Mapping[str, Any]) -> bool:
    """Whether a probe proves the micro-batch too large for memory: only an `oom` (the slot's cap,
    an allocator's exception in the rank, or its traceback on a wrapper's stderr: workers.oom). On a
    GPU node most other failures are infrastructure (a timeout, a lost node, a port clash, a JIT
    build): taken as memory bounds they would prune the optimum (issue 21 item 7). Nor is an `oom`
    while other processes held memory on its GPU (`device_foreign_bytes`, workers.device_idle): the
    config may fit the GPU it would train on (issue 21 item 9)."""
    return record.get("status") == "oom" and not record.get("device_foreign_bytes")


def _peak(record: Mapping[str, Any], key: str) -> int | None:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return None
    return int(value)


def measured_reserve(record: Mapping[str, Any], host_memory: bool) -> int | None:
    """What the profile run's busiest rank held on its GPU outside the allocator at the end (the
    CUDA context, NCCL's buffers: `device_untracked_bytes` = total - free - reserved, from
    workers.device_memory), less what other processes held there (`device_foreign_bytes`, not the
    job's); None on host memory or without the figure. It replaces the reserve's guess when larger
    (NCCL alone takes 1.6 GB with one communicator and about 6 GB with three or more, issue 21 item
    8); never lowers it, since NCCL connects lazily and the profile exits in its first forward."""
    untracked = _peak(record, "device_untracked_bytes")
    if host_memory or untracked is None:
        return None
    return max(0, untracked - (_peak(record, "device_foreign_bytes") or 0))


def refuse_unbuildable_op(exp: Experiment, record: Mapping[str, Any]) -> None:
    """Raise SearchAborted when `record` died because an op DeepSpeed needs could not be built or
    loaded (`workers.op_build`): the user's config needs it at every stage and size, so every later
    experiment would crash the same way. A full-mode knob point (its own `tuning_space`) may need an
    op the user's config does not; it only fails that point."""
    failure = record.get("op_build_failed")
    if not failure or (exp.tuning_space and exp.tuning_space != PROFILE):
        return
    slot = (record.get("cause") or {}).get("slot")
    raise SearchAborted(
        f"{exp.name} could not build or load an op DeepSpeed needs"
        f"{f' on slot {slot}' if slot else ''} ({failure}); every experiment of this config would fail "
        "alike: install the CUDA toolkit whose nvcc matches torch's CUDA on every node (or pre-build the "
        "ops: DS_BUILD_OPS=1 pip install deepspeed), or use an optimizer that needs no op (\"torch_adam\": "
        f"true in optimizer.params); the build log is {exp.name}/stderr.log in the results folder, and the "
        "same command resumes once it builds")


def _profile(session: _Session) -> Step:
    [record] = yield from session.measure(PROFILE, [session.profile_experiment()])
    info = ModelInfo.from_mapping(record.get("metrics")) if _ok(record) else None
    if info is not None:
        return info, _peak(record, session.settings.peak_memory_key)
    status = record.get("status", "lost")
    if status == "oom":
        raise SearchAborted(f"the model-info profile run {PROFILE} (ZeRO-3, micro-batch 1) ran out of memory: "
                            "the model fits these slots at no stage; use slots with more memory, more GPUs per "
                            "experiment, or zero_optimization.offload_param / offload_optimizer")
    raise SearchAborted(f"the model-info profile run {PROFILE} ended '{status}' without num_params and "
                        f"activation_mem_per_gpu; see {PROFILE}/stderr.log in the results folder, or give "
                        "them in autotuning.model_info")


def _feasible_stages(session: _Session) -> tuple[int, ...]:
    fits = [session.gate(stage) for stage in session.settings.stages]
    feasible = tuple(fit.stage for fit in fits if fit.feasible)
    if feasible:
        return feasible
    closest = min(fits, key=lambda fit: (fit.shortfall_bytes, fit.stage))
    raise NoStageFits(
        f"no allowed ZeRO stage fits micro-batch 1 in the slots' {_gib(closest.capacity_bytes)}: stage "
        f"{closest.stage} needs about {_gib(closest.required_bytes)}, {_gib(closest.shortfall_bytes)} more; use "
        "slots with more memory, more GPUs per experiment, offload, or allow a higher zero_optimization.stage",
        closest.shortfall_bytes)


def _gib(size: int) -> str:
    return f"{size / GiB:.2f} GiB"


def _run_list(session: _Session, stage: int) -> Step:
    """The user's own micro-batch list, as DeepSpeed runs it: every size gets gas = mtbpg // size, so
    all of them train on about the same number of samples per GPU and optimizer step."""
    st = session.settings
    mtbpg = max(st.micro_batch_sizes) * st.gradient_accumulation_steps
    yield from session.measure(f"z{stage}_list",
                               [session.experiment(stage, m, max(1, mtbpg // m)) for m in st.micro_batch_sizes])


def _tune_stage(session: _Session, stage: int, prev_max: int) -> Step:
    """Returns (the stage's best micro-batch size by the metric, the largest that ran, (candidate
    sizes, mtbpg) for full mode); (0, 0, None) when the stage is skipped or even its smallest fails."""
    st = session.settings
    if prev_max and session.predicted_max(stage, safety=1.0) < prev_max:
        return 0, 0, None  # it cannot hold a larger batch than an earlier, cheaper stage (DeepSpeed's rule)
    start = prev_max or min(max(st.first_micro_batch_size, st.min_micro_batch_size), st.micro_batch_cap)
    top = yield from _min_and_max(session, stage, start, "min_max")
    if top is None and not prev_max and start != st.min_micro_batch_size:
        start = st.min_micro_batch_size
        top = yield from _min_and_max(session, stage, start, "min_fallback")
    if top is None:
        return 0, 0, None
    if top == start:
        top = yield from _bisect(session, stage, start)
    candidates = yield from _candidates_and_fine(session, stage, start, top)
    return session.best_mbs(stage), top, candidates


def _min_and_max(session: _Session, stage: int, start: int, label: str) -> Step:
    """`start` and the max probes in one phase: None if `start` failed, else the largest size that ran
    (DeepSpeed takes the first max probe that succeeds, largest first)."""
    st = session.settings
    probes = max_probes(session.predicted_max(stage), start, st.micro_batch_cap, session.smallest_failure(stage))
    sizes = (start, *probes)
    experiments = [session.experiment(stage, m, st.gradient_accumulation_steps) for m in sizes]
    records = yield from session.measure(f"z{stage}_{label}", experiments)
    if not _ok(records[0]):
        return None
    return max(m for m, record in zip(sizes, records) if _ok(record))


def _bisect(session: _Session, stage: int, start: int) -> Step:
    """Binary search above `start` (which ran) up to the smallest failure, or the prediction when
    nothing failed; stops when a larger batch improves the metric by less than PLATEAU, or when the
    calibrated memory line says no larger size fits."""
    st = session.settings
    gas = st.gradient_accumulation_steps
    failure = session.smallest_failure(stage)
    high = min(st.micro_batch_cap, failure - 1 if failure is not None else session.predicted_max(stage))
    good = start
    previous = session.metric(experiment_name(stage, gas, start))
    while good < high:
        mid = _next_probe(session, stage, good, high)
        if mid is None:
            break
        [record] = yield from session.measure(f"z{stage}_bisect_{mid}", [session.experiment(stage, mid, gas)])
        if not _ok(record):
            high = mid - 1
            continue
        good = mid
        value = metric_value(record, st.metric)
        if previous and value is not None and gain(previous, value, st.maximize) < PLATEAU:
            break
        previous = value
    return good


def _next_probe(session: _Session, stage: int, good: int, high: int) -> int | None:
    """The bisection midpoint, lowered to the calibrated prediction: the one with the safety margin
    while it is above `good`, then the unmargined one; None when even that says nothing larger fits.
    DeepSpeed's estimate does not learn from probes, so with it this is the plain midpoint."""
    mid = (good + 1 + high) // 2
    if session.settings.estimator != "calibrated":
        return mid
    for safety in (SAFETY, 1.0):
        predicted = session.predicted_max(stage, safety)
        if predicted > good:
            return min(mid, predicted)
    return None


def _candidates_and_fine(session: _Session, stage: int, start: int, top: int) -> Step:
    """DeepSpeed's candidate list with gas from mtbpg, all in one phase, then the fine-grained search
    down from the largest size with its gas, while each step improves the metric by more than PLATEAU."""
    st = session.settings
    mtbpg = max_train_batch_size_per_gpu(top, st.gradient_accumulation_steps, st.dp_size, st.max_train_batch_size)
    sizes = tuning_micro_batch_sizes(start, top, st.num_tuning_micro_batch_sizes, mtbpg)
    yield from session.measure(f"z{stage}_candidates",
                               [session.experiment(stage, m, max(1, mtbpg // m)) for m in sizes])
    gas = max(1, mtbpg // top)
    best_value = session.metric(experiment_name(stage, gas, top))
    for mbs in fine_grained_micro_batch_sizes(sizes, start, top):
        if best_value is None:
            break
        [record] = yield from session.measure(f"z{stage}_fine_{mbs}", [session.experiment(stage, mbs, gas)])
        value = metric_value(record, st.metric)
        if value is None or gain(best_value, value, st.maximize) <= PLATEAU:
            break
        best_value = value
    return sizes, mtbpg


def tune_full_space(session: _Session, stage: int, sizes: Sequence[int], mtbpg: int) -> Step:
    """Full mode for one stage: DeepSpeed's ZeRO-knob space x the fast search's candidate sizes, explored
    by the configured tuner in batches as wide as the slots allow, until its trial cap or early stop."""
    st = session.settings
    cfg = st.tuning_config
    if cfg is None:
        return
    experiments = full_experiments(cfg, stage, sizes, mtbpg, st.num_nodes, st.num_gpus)
    tuner = make_tuner(st.tuner_type, experiments, seed=st.tuner_seed, maximize=st.maximize)
    rule = StopRule(st.maximize, st.tuner_num_trials, st.tuner_early_stopping)
    history: list[Trial] = []
    while batch := plan(tuner, history, rule, st.concurrency):
        records = yield from session.measure(f"{experiments[0].space}_trial{len(history) + 1}",
                                             [experiments[i] for i in batch])
        history.extend(Trial(i, metric_value(record, st.metric)) for i, record in zip(batch, records))


def _best_name(session: _Session, stage: int) -> str:
    pairs = session.stage_records(stage)
    winner = best([rec for _, rec in pairs], session.settings.metric, session.settings.maximize)
    return winner["name"] if winner else ""


def _worse(value: float | None, reference: float | None, maximize: bool) -> bool:
    if reference is None:
        return False
    if value is None:
        return True
    return value < reference if maximize else value > reference
