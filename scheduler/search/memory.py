"""Per-rank memory of one training run: an analytical model that opens the search, then measured lines.

Why: DeepSpeed's autotuner picks the ZeRO stages to try and the micro-batch sizes to probe from an
estimate that is wrong in several ways (fp32 counted as 16 bytes per parameter, bf16 treated as fp32,
mp_size dividing the model a second time after ZeRO sharding, offload ignored). Each wrong guess costs
an out-of-memory probe: a process start, a model load and a crash. Here the analytical model is only
the opening guess. Every successful probe reports its peak memory; a line mem(mbs) = a + b*mbs is
fitted per stage, carried to the next stage by the analytical difference between the two stages, and
bounded from above by the OOMs seen, so later probes land just under the real limit
(`scheduler.search.memory_facts` reads the model against what ran: the predictions the search uses).

Numbers used (documented choices, not measurements):
- Model states per parameter: fp32 4 (weights) + 4 (gradients) + 12 (Adam); fp16/bf16 2 + 2 + 12,
  where 12 is Adam's two fp32 moments plus an fp32 master copy of the weights. For pure fp32 without
  ZeRO the master copy does not exist, so the model over-counts by 4 bytes there; calibration absorbs it.
- DeepSpeed's flat gradient buckets (`MemoryModel.buffer_bytes`), allocated whole whatever the
  model's size: `reduce_bucket_size` elements (5e8 by default) in the training precision, one at
  ZeRO-1/2 from the start of each backward (two with overlap_comm), one at ZeRO-3 when its optimizer
  is built (so the profile run's peak holds it); none with contiguous_gradients false, none at
  ZeRO-0. 1 GB in fp16 by default: for a small model on a GPU, ZeRO-1 holds more than ZeRO-0. On
  host memory only the pages the gradients are copied into count (at most the model's gradients).
  The fp32 gradient copies DeepSpeed makes at the optimizer step (FP16_Optimizer's flat copy, ZeRO's
  fp32 partition) are left out: they exist after backward has freed the activations, so they raise
  the peak only where activations are smaller than they are, which the measured lines see.
- The overhead (what a rank holds besides model states and activations) comes from the profile run
  when it measured its peak: that peak minus the model states and the bucket at stage 3 and one
  sample's activations (`overhead_from_profile`). Unmeasured, it is a prior (`prior_overhead_bytes`): 512 MiB
  of framework runtime on CPU slots; on GPUs max(2 GiB, 6 % of the device), because a GPU process
  also holds its CUDA context, the allocator's cache and communication buffers (1-2 GiB is typical).
  The fitted intercept replaces it once the stage's own probes are measured.
- `untracked_reserve_bytes`: on GPUs the measured peak (torch's max_memory_reserved) never includes
  the CUDA context and NCCL's buffers, yet they share the device: max(1 GiB, 2.5 % of the device)
  is taken off the capacity before any measured line is compared with it (more when the profile run
  measured more: `session.measured_reserve`). Host PSS on CPU slots
  counts everything, so the reserve is 0 there.
- A peak that is missing, or does not grow with the micro-batch (a script without torch, a CPU-only
  measurement of a GPU job), is never fitted (`peak_grows`): the model then uses the profile and
  the ok/failed bounds only.
- `SAFETY` (0.95): fitted lines predict the largest batch whose memory stays under 95 % of the
  capacity, because peak memory varies a few percent between runs (allocator fragmentation, the
  monitor's sampling) and the fit is used to pick probes directly. The analytical model is used
  without the margin, like DeepSpeed's estimate: its probes already straddle the prediction by 5 %.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_OVERHEAD_BYTES = 512 * MiB
#: GPU priors (module docstring): the whole overhead when unmeasured, and what torch never sees.
GPU_OVERHEAD_FLOOR = 2 * GiB
GPU_OVERHEAD_SHARE = 0.06
GPU_UNTRACKED_FLOOR = 1 * GiB
GPU_UNTRACKED_SHARE = 0.025
#: The slope from the analytical intercept to one measured size is trusted from this size up: an
#: intercept off by e bytes moves it by e / mbs.
PSEUDO_SLOPE_MIN_MBS = 8
#: A fitted slope below this share of the profile's activation figure is not a memory that grows.
MIN_GROWTH_SHARE = 0.25
SAFETY = 0.95
#: A micro-batch size no configuration reaches; returned when memory does not grow with the batch.
NO_LIMIT = 1 << 31
#: Adam's two fp32 moments plus the fp32 master copy of the weights.
_OPTIMIZER_BYTES = 12
#: DeepSpeed's default zero_optimization.reduce_bucket_size (elements), at every stage.
DEFAULT_REDUCE_BUCKET_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class ModelInfo:
    """What the profile run (or the user's `autotuning.model_info`) says about the model."""

    num_params: int  #: whole model, all model-parallel ranks together
    trainable_num_params: int
    activation_mem_per_gpu: int  #: bytes of activations for one sample on one rank

    @classmethod
    def from_mapping(cls, data: Any) -> ModelInfo | None:
        """From a profile record's metrics or `autotuning.model_info`; None when a value is missing."""
        if not isinstance(data, Mapping):
            return None
        num_params = _number(data.get("num_params"))
        activation = _number(data.get("activation_mem_per_gpu"))
        if not num_params or activation is None:
            return None
        trainable = _number(data.get("trainable_num_params"))
        trainable = num_params if trainable is None else min(trainable, num_params)
        return cls(num_params, trainable, max(activation, 0))


def _number(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value)


@dataclass(frozen=True)
class TrainingSetup:
    """The parts of a run's shape and ds_config that decide where model states live."""

    world_size: int = 1
    mp_size: int = 1
    mixed_precision: bool = False  #: fp16 or bf16 weights and gradients
    offload_optimizer: bool = False  #: optimizer states leave the memory the capacity measures
    offload_param: bool = False  #: parameters leave it (ZeRO-3 only)
    #: zero_optimization.reduce_bucket_size, the elements of each gradient bucket DeepSpeed allocates
    #: whole (0: none, as with contiguous_gradients false; `MemoryModel.buffer_bytes`)
    reduce_bucket_elements: int = 0
    overlap_comm: bool | None = None  #: None: DeepSpeed's default (on at ZeRO-3 only)
    host_memory: bool = False  #: the capacity is host RAM, where an untouched page costs nothing

    @property
    def dp_size(self) -> int:
        """Ranks that ZeRO shards over: the model-parallel groups split the world first."""
        return max(1, self.world_size // max(1, self.mp_size))

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any], world_size: int, mp_size: int = 1,
                       host_memory: bool = False) -> TrainingSetup:
        """`host_memory`: the capacity is host RAM (a CPU slot), so offloading to "cpu" frees nothing."""
        zero = ds_config.get("zero_optimization")
        zero = zero if isinstance(zero, Mapping) else {}
        freeing = ("nvme",) if host_memory else ("cpu", "nvme")
        bucket = _number(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET_ELEMENTS))
        overlap = zero.get("overlap_comm")
        return cls(world_size=world_size, mp_size=mp_size, mixed_precision=mixed_precision(ds_config),
                   offload_optimizer=_offload_device(zero, "offload_optimizer") in freeing,
                   offload_param=_offload_device(zero, "offload_param") in freeing,
                   reduce_bucket_elements=0 if zero.get("contiguous_gradients") is False else bucket or 0,
                   overlap_comm=overlap if isinstance(overlap, bool) else None, host_memory=host_memory)


def mixed_precision(ds_config: Mapping[str, Any]) -> bool:
    """fp16 or bf16 enabled ("auto" counts as enabled: the smaller estimate, so no stage is wrongly skipped)."""
    for key in ("fp16", "bf16", "bfloat16"):
        section = ds_config.get(key)
        if isinstance(section, Mapping) and section.get("enabled") in (True, "auto"):
            return True
    return False


def _offload_device(zero: Mapping[str, Any], key: str) -> str:
    section = zero.get(key)
    device = section.get("device") if isinstance(section, Mapping) else None
    return device.lower() if isinstance(device, str) else "none"


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes held by one rank."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state_bytes(info: ModelInfo, setup: TrainingSetup, stage: int) -> StateBytes:
    """Per-rank model states at a ZeRO stage: model parallelism splits the model once, ZeRO shards
    the optimizer (stage >= 1), gradients (>= 2) and parameters (3) over the data-parallel ranks."""
    width = 2 if setup.mixed_precision else 4
    params = _ceil_div(info.num_params, setup.mp_size)
    trainable = _ceil_div(info.trainable_num_params, setup.mp_size)
    dp = setup.dp_size
    return StateBytes(
        params=0 if stage >= 3 and setup.offload_param else _ceil_div(params * width, dp if stage >= 3 else 1),
        grads=_ceil_div(trainable * width, dp if stage >= 2 else 1),
        optimizer=0 if setup.offload_optimizer else _ceil_div(trainable * _OPTIMIZER_BYTES, dp if stage >= 1 else 1),
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // max(1, b))


@dataclass(frozen=True)
class StageFit:
    """Whether a stage can run micro-batch 1 at all, and by how much it misses."""

    stage: int
    required_bytes: int
    capacity_bytes: int

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.required_bytes - self.capacity_bytes)

    @property
    def feasible(self) -> bool:
        return self.shortfall_bytes == 0


@dataclass(frozen=True)
class MemoryModel:
    """The analytical estimate: model states + fixed overhead + activations per sample."""

    info: ModelInfo
    setup: TrainingSetup
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES

    def state(self, stage: int) -> StateBytes:
        return model_state_bytes(self.info, self.setup, stage)

    def buffer_bytes(self, stage: int) -> int:
        """DeepSpeed's gradient buckets, allocated whole whatever the model's size (module docstring):
        at ZeRO-1/2 one of `reduce_bucket_size` elements at the start of each backward, two with
        overlap_comm; at ZeRO-3 one, when the optimizer is built. On host memory only the pages the
        gradients are copied into are touched: at most the model's gradients per bucket."""
        setup = self.setup
        if not setup.reduce_bucket_elements or stage == 0:
            return 0
        buckets = 2 if stage in (1, 2) and setup.overlap_comm else 1
        elements = setup.reduce_bucket_elements
        if setup.host_memory:
            elements = min(elements, _ceil_div(self.info.trainable_num_params, setup.mp_size))
        return buckets * elements * (2 if setup.mixed_precision else 4)

    def held_bytes(self, stage: int) -> int:
        """What the stage holds that another stage may not, at any micro-batch: its model states and
        DeepSpeed's buckets (the overhead is common to all)."""
        return self.state(stage).total + self.buffer_bytes(stage)

    def fixed_bytes(self, stage: int) -> int:
        """Memory that does not grow with the micro-batch."""
        return self.held_bytes(stage) + self.overhead_bytes

    def required_bytes(self, stage: int, mbs: int) -> int:
        return self.fixed_bytes(stage) + self.info.activation_mem_per_gpu * mbs

    def fits(self, stage: int, mbs: int, capacity_bytes: int) -> bool:
        return self.required_bytes(stage, mbs) <= capacity_bytes

    def max_micro_batch_size(self, stage: int, capacity_bytes: int) -> int:
        """The largest micro-batch that fits (0: not even one sample)."""
        return _line_max(self.fixed_bytes(stage), self.info.activation_mem_per_gpu, capacity_bytes)

    def gate(self, stage: int, capacity_bytes: int) -> StageFit:
        return StageFit(stage, self.required_bytes(stage, 1), capacity_bytes)


def stage_gate(model: MemoryModel, stages: Sequence[int], capacity_bytes: int) -> tuple[StageFit, ...]:
    """One `StageFit` per stage, in the given order."""
    return tuple(model.gate(stage, capacity_bytes) for stage in stages)


def _line_max(intercept: float, slope: float, budget: float) -> int:
    if slope <= 0:
        return NO_LIMIT if intercept <= budget else 0
    return max(0, min(NO_LIMIT, math.floor((budget - intercept) / slope)))


# ---------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Observation:
    """One finished probe of a stage: a measured peak (success) or an OOM (an upper bound)."""

    micro_batch_size: int
    peak_bytes: int | None = None  #: None: succeeded without a usable measurement, or failed
    oom: bool = False


@dataclass(frozen=True)
class Calibration:
    """A fitted line mem(mbs) = intercept + slope * mbs for one stage."""

    intercept: float
    slope: float
    points: int  #: distinct micro-batch sizes the fit used

    def bytes_at(self, mbs: int) -> float:
        return self.intercept + self.slope * mbs

    def max_micro_batch_size(self, capacity_bytes: int, safety: float = SAFETY) -> int:
        return _line_max(self.intercept, self.slope, capacity_bytes * safety)

    def shifted(self, delta_bytes: float) -> Calibration:
        """The same line moved by `delta_bytes`: another stage's fit carried to this one."""
        return Calibration(self.intercept + delta_bytes, self.slope, self.points)


def prior_overhead_bytes(capacity_bytes: int, host_memory: bool) -> int:
    """The overhead before anything is measured (module docstring)."""
    if host_memory:
        return DEFAULT_OVERHEAD_BYTES
    return max(GPU_OVERHEAD_FLOOR, int(GPU_OVERHEAD_SHARE * capacity_bytes))


def untracked_reserve_bytes(capacity_bytes: int, host_memory: bool) -> int:
    """Device memory no measured peak includes (CUDA context, NCCL); 0 on host memory."""
    if host_memory:
        return 0
    return max(GPU_UNTRACKED_FLOOR, int(GPU_UNTRACKED_SHARE * capacity_bytes))


def overhead_from_profile(info: ModelInfo, setup: TrainingSetup, peak_bytes: int | None) -> int | None:
    """What the profile run (stage 3, micro-batch 1) held beyond its model states and one sample's
    activations, in the units of the measured peak; None when it measured no peak."""
    if not peak_bytes:
        return None
    held = MemoryModel(info, setup, 0).held_bytes(3)  # ZeRO-3 built its bucket before the profiled forward
    return max(0, peak_bytes - held - info.activation_mem_per_gpu)


def peak_grows(observations: Sequence[Observation], prior_slope: float) -> bool:
    """Whether the measured peaks grow with the micro-batch as a device's memory does: always true
    with one measured size (nothing to tell), else the fitted slope must reach MIN_GROWTH_SHARE of
    the profile's activations (or, without that figure, add 2 % of the peak over the sizes measured)."""
    points = [(o.micro_batch_size, o.peak_bytes) for o in observations if o.peak_bytes and not o.oom]
    if len({x for x, _ in points}) < 2:
        return True
    slope = _least_squares(points)[1]
    if prior_slope > 0:
        return slope >= MIN_GROWTH_SHARE * prior_slope
    sizes = [x for x, _ in points]
    return slope > 0 and slope * (max(sizes) - min(sizes)) >= 0.02 * (sum(y for _, y in points) / len(points))


def _least_squares(points: Sequence[tuple[int, int]]) -> tuple[float, float]:
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if not spread:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
    return mean_y - slope * mean_x, slope


def calibrate(observations: Sequence[Observation], prior_slope: float,
              growth_slope: float | None = None) -> Calibration | None:
    """Least squares over the measured peaks (None without any, or when they do not grow with the
    micro-batch: `peak_grows` against `growth_slope`, default `prior_slope`). With one distinct micro-batch size the slope is `prior_slope` and
    only the intercept is fitted; a negative slope is clamped to 0."""
    points = [(o.micro_batch_size, o.peak_bytes) for o in observations if o.peak_bytes and not o.oom]
    if not points or not peak_grows(observations, prior_slope if growth_slope is None else growth_slope):
        return None
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    distinct = len(set(xs))
    if distinct == 1:
        slope = max(0.0, prior_slope)
    else:
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread)
    return Calibration(mean_y - slope * mean_x, slope, distinct)


def bounds(observations: Sequence[Observation]) -> tuple[int, int | None]:
    """(largest micro-batch that succeeded or 0, smallest that ran out of memory or None)."""
    ok = [o.micro_batch_size for o in observations if not o.oom]
    ooms = [o.micro_batch_size for o in observations if o.oom]
    return max(ok, default=0), min(ooms, default=None)
