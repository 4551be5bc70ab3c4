"""A search's state and settings, shared by both searches: what was measured, what memory it proves.

Why its own module: DeepSpeed's algorithm (`scheduler.search.fast_search`) and the sampled search
(`scheduler.search.sampled_search`) both run over one `Session` (every experiment measured so far,
the memory model calibrated by the profile run) and one `SearchSettings`; with the session inside
fast_search the two modules imported each other. Here it sits below both.

Also here: what a record proves (`too_large`: only an `oom` is a memory bound; `measured_reserve`,
`measured_capacity`),
and the refusals that end a search with one line (`SearchAborted`: an op that cannot be built).
"""
from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.errors import UsageError
from scheduler.inputs.batch_keys import GlobalBatch, on_gpus
from scheduler.inputs.config import TuningConfig
from scheduler.inputs.memory_strategies import MemoryStrategyKeys
from scheduler.search.deepspeed_memory import deepspeed_fp16, deepspeed_max_micro_batch_size, deepspeed_stage_fits
from scheduler.search.memory import (
    SAFETY, MemoryModel, ModelInfo, Observation, StageFit, TrainingSetup, untracked_reserve_bytes,
)
from scheduler.search.memory_facts import SharedFacts, predict_max_micro_batch_size, shared_facts
from scheduler.search.phases import Phase
from scheduler.search.ranking import best, metric_value
from scheduler.search.space import PROFILE, Experiment, experiment_config, experiment_name, profile_name, strategy_of
from workers.files.layout import MODEL_INFO

Step = Generator[Phase, dict[str, dict], Any]

#: DeepSpeed's memory estimate or ours, calibrated from the profile run's peak (autotuning.estimator).
ESTIMATORS = ("calibrated", "deepspeed")


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
    #: the user's global batch, kept by every experiment when `size` is set (`inputs.batch_keys.global_batch`)
    global_batch: GlobalBatch = GlobalBatch()
    strategy: tuple[str, ...] = ()  #: every experiment's memory strategies (`strategy_fit.stages_that_fit`)
    checkpointing_fixed: bool = False  #: the script's own arguments turn activation checkpointing on
    #: the strategies the user allows and where offload goes (`inputs.memory_strategies`)
    memory_strategies: MemoryStrategyKeys = MemoryStrategyKeys()

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus

    @property
    def dp_size(self) -> int:
        return max(1, self.world_size // self.mp_size)

    @property
    def kept_per_gpu(self) -> int | None:
        """Samples per GPU and step every experiment keeps (the user's global batch / dp; None: free)."""
        return self.global_batch.per_gpu(self.dp_size)

    @property
    def micro_batch_cap(self) -> int:
        """max_train_micro_batch_size_per_gpu, lowered so one step stays within max_train_batch_size
        (or the kept global batch)."""
        if self.kept_per_gpu:
            return max(1, min(self.max_micro_batch_size, self.kept_per_gpu))
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
        """Samples per GPU per optimizer step: the kept global batch's share, else what
        max_train_batch_size allows (None: no limit)."""
        if self.kept_per_gpu:
            return self.kept_per_gpu
        return max(1, self.max_train_batch_size // self.dp_size) if self.max_train_batch_size else None

    def gas_for(self, mbs: int) -> int:
        """The accumulation that keeps mbs * gas within max_train_batch_size, or equal to the kept
        batch's share for a size dividing it (the user's gas without either)."""
        per_step = self.samples_per_step
        return max(1, per_step // mbs) if per_step else self.gradient_accumulation_steps

    @property
    def setup(self) -> TrainingSetup:
        return TrainingSetup.from_ds_config(self.ds_config, self.world_size, self.mp_size, self.host_memory)

    @classmethod
    def from_config(cls, cfg: TuningConfig, *, capacity_bytes: int, num_nodes: int, num_gpus: int,
                    device_kind: str = "gpu", estimator: str = "calibrated",
                    concurrency: int = 1, command_line: tuple[int, int] | None = None,
                    checkpointing_fixed: bool = False) -> SearchSettings:
        """The config's typed keys (`search_keys`, with DeepSpeed's defaults) on the experiment's GPUs;
        the global batch kept and the listed sizes keeping it come checked from
        `scheduler.inputs.batch_keys.on_gpus`, whose ConfigError names the file and the fix.
        `command_line`: (per-device size, accumulation) the script's flags give through arg_mappings
        (`batch_keys.cli_batch`), the batch a Hugging Face config keeps when asked to."""
        if device_kind not in ("cpu", "gpu") or estimator not in ESTIMATORS:
            raise ValueError(f"device_kind {device_kind!r} or estimator {estimator!r} is not known")
        keys = cfg.search_keys
        batch = on_gpus(cfg.path, cfg.batch_keys, keys, num_nodes * num_gpus, command_line)
        return cls(
            ds_config=cfg.ds_config, capacity_bytes=capacity_bytes, stages=cfg.stages, metric=cfg.metric,
            maximize=cfg.maximize, start_profile_step=cfg.start_profile_step,
            end_profile_step=cfg.end_profile_step, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            first_micro_batch_size=cfg.micro_batch_sizes[0], micro_batch_sizes=batch.micro_batch_sizes,
            min_micro_batch_size=keys.min_micro_batch_size, max_micro_batch_size=keys.max_micro_batch_size,
            max_train_batch_size=keys.max_train_batch_size,
            num_tuning_micro_batch_sizes=keys.num_tuning_micro_batch_sizes,
            mp_size=keys.mp_size, model_info=ModelInfo.from_mapping(keys.model_info),
            num_nodes=num_nodes, num_gpus=num_gpus, host_memory=device_kind == "cpu",
            peak_memory_key="peak_rss_bytes" if device_kind == "cpu" else "peak_device_bytes", estimator=estimator,
            search=keys.search, fast=keys.fast, tuner_type=keys.tuner_type, tuner_num_trials=keys.tuner_num_trials,
            tuner_early_stopping=keys.tuner_early_stopping, tuner_seed=keys.tuner_seed, concurrency=max(1, concurrency),
            tuning_config=cfg, global_batch=batch.global_batch, checkpointing_fixed=checkpointing_fixed,
            memory_strategies=cfg.memory_strategies,
        )


class Session:
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

    def experiment(self, stage: int, mbs: int, gas: int, strategy: tuple[str, ...] | None = None) -> Experiment:
        st, strategy = self.settings, self.settings.strategy if strategy is None else strategy
        config = experiment_config(st.ds_config, stage, mbs, gas, st.dp_size, st.start_profile_step,
                                   st.end_profile_step, strategy, st.memory_strategies.nvme_path)
        return Experiment(experiment_name(stage, gas, mbs, strategy), stage, mbs, gas, config, st.num_nodes,
                          st.num_gpus, strategy=strategy_of(strategy))

    def profile_experiment(self, strategy: tuple[str, ...] = ()) -> Experiment:
        st = self.settings
        config = experiment_config(st.ds_config, 3, 1, 1, st.dp_size, st.start_profile_step, st.end_profile_step,
                                   strategy, st.memory_strategies.nvme_path)
        config["memory_breakdown"] = False
        config["autotuning"]["model_info"] = {"profile": True}
        return Experiment(profile_name(strategy), 3, 1, 1, config, st.num_nodes, st.num_gpus, tuning_space=PROFILE,
                          metric_file=MODEL_INFO, strategy=strategy_of(strategy))

    def stage_records(self, stage: int) -> list[tuple[Experiment, dict[str, Any]]]:
        """The stage's experiments with the search's own strategies (a strategy probe is another config)."""
        return [(exp, rec) for exp, rec in self.measured.values()
                if exp.stage == stage and exp.space != PROFILE and exp.strategy == self.settings.strategy]

    def observations(self) -> dict[int, list[Observation]]:
        """Per stage: measured peaks of successes, and upper bounds: every `oom` (`too_large`) at a
        size larger than any the stage ran (an out-of-memory at or below a size that ran is the GPU's
        state, not the config's). A timeout, a lost node or a plain crash says nothing about memory
        and is no memory fact."""
        found: dict[int, list[Observation]] = {}
        for stage in sorted({exp.stage for exp, _ in self.measured.values()}):
            records = self.stage_records(stage)
            largest_ok = max((exp.micro_batch_size for exp, record in records if succeeded(record)), default=0)
            for exp, record in records:
                if succeeded(record):
                    peak = peak_of(record, self.settings.peak_memory_key)
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

    def predicted_max(self, stage: int, safety: float = SAFETY, cautious: bool = False) -> int:
        """The largest micro-batch the stage is expected to hold (`memory_facts.predict_max_micro_batch_size`;
        `cautious`: for the stage's first probe), within the micro-batch cap."""
        st = self.settings
        if st.estimator == "deepspeed":
            predicted = deepspeed_max_micro_batch_size(self.model.info, stage, deepspeed_fp16(st.ds_config),
                                                       st.world_size, st.mp_size, st.capacity_bytes)
        else:
            predicted = predict_max_micro_batch_size(self.model, stage, st.budget_bytes, self.observations(), safety,
                                                    cautious)
        return min(predicted, st.micro_batch_cap)

    def shared_facts(self, stage: int) -> SharedFacts:
        """What the other stages' probes prove or predict about this stage's largest micro-batch."""
        if self.settings.estimator == "deepspeed":
            return SharedFacts()
        return shared_facts(self.model, stage, self.settings.budget_bytes, self.observations())

    def smallest_failure(self, stage: int) -> int | None:
        return min((exp.micro_batch_size for exp, rec in self.stage_records(stage) if not succeeded(rec)), default=None)

    def metric(self, name: str) -> float | None:
        entry = self.measured.get(name)
        return metric_value(entry[1], self.settings.metric) if entry else None

    def best_mbs(self, stage: int) -> int:
        pairs = self.stage_records(stage)
        winner = best([rec for _, rec in pairs], self.settings.metric, self.settings.maximize)
        return next((exp.micro_batch_size for exp, rec in pairs if rec is winner), 0)


def succeeded(record: Mapping[str, Any]) -> bool:
    """Whether the experiment ran and reported its metrics."""
    return record.get("status") == "ok"


def too_large(record: Mapping[str, Any]) -> bool:
    """Whether a probe proves the micro-batch too large for memory: only an `oom` (the slot's cap,
    an allocator's exception in the rank, or its traceback on a wrapper's stderr: workers.in_rank.oom). On a
    GPU node most other failures are infrastructure (a timeout, a lost node, a port clash, a JIT
    build): taken as memory bounds they would prune the optimum. Nor is an `oom` under other
    processes' memory (`under_foreign_memory`): the config may fit the GPU it would train on."""
    return record.get("status") == "oom" and not under_foreign_memory(record)


def under_foreign_memory(record: Mapping[str, Any]) -> bool:
    """Whether other processes held memory on a GPU of the experiment: when it started
    (`device_foreign_bytes`, from records before ranks stopped starting beside them) or a wait after
    its ranks ended (`device_foreign_after_bytes`: they may have been there during the run;
    workers.device.device_idle, workers.state.slot_health)."""
    return bool(record.get("device_foreign_bytes")) or bool(record.get("device_foreign_after_bytes"))


def peak_of(record: Mapping[str, Any], key: str) -> int | None:
    """The record's figure `key` (a peak in bytes) when it is a positive number, else None."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return None
    return int(value)


def measured_reserve(record: Mapping[str, Any], host_memory: bool) -> int | None:
    """What the profile run's busiest rank held on its GPU outside the allocator at the end (the
    CUDA context, NCCL's buffers: `device_untracked_bytes` = total - free - reserved, from
    workers.in_rank.device_memory), less what other processes held on that same GPU (`device_foreign_bytes`,
    not the job's; per rank: `device_own_untracked_bytes`); None on host memory or without the figure. It replaces the reserve's guess when larger
    (NCCL alone takes 1.6 GB with one communicator and about 6 GB with three or more); never
    lowers it, since NCCL connects lazily and the profile exits in its first forward."""
    if host_memory:
        return None
    own = record.get("device_own_untracked_bytes")  # each rank's less its own GPU's foreign memory
    if isinstance(own, int) and not isinstance(own, bool) and own >= 0:
        return own
    untracked = peak_of(record, "device_untracked_bytes")  # a record from before the per-rank figure
    if untracked is None:
        return None
    return max(0, untracked - (peak_of(record, "device_foreign_bytes") or 0))


def measured_capacity(record: Mapping[str, Any], host_memory: bool) -> int | None:
    """The device memory CUDA itself reported to the profile run's ranks (`device_total_bytes`,
    `torch.cuda.mem_get_info`'s total, the smallest GPU of the gang), or None on host memory or without
    the figure. It is what the allocator can have: nvidia-smi's `memory.total`, the slot's advertised
    capacity, also counts memory the driver keeps for itself (about 0.5 GiB on an 80 GB GPU), which
    no experiment can use."""
    return None if host_memory else peak_of(record, "device_total_bytes")


def refuse_unbuildable_op(exp: Experiment, record: Mapping[str, Any]) -> None:
    """Raise SearchAborted when `record` died because an op DeepSpeed needs could not be built or
    loaded (`workers.in_rank.op_build`): the user's config needs it at every stage and size, so every later
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
