"""Synthetic GPU-like training scripts ("surfaces") for replaying searches without a cluster.

Why: a search's quality (fraction of the optimum found, launches, failed probes) can only be judged
over many scripts whose optimum is known. A surface is a pure function from an experiment (ZeRO
stage, micro-batch size, gradient accumulation, ZeRO knobs) to the record a real run of a GPU
training script would leave: device memory that grows with the micro-batch, a failed run when the
device is full, throughput that saturates, may peak at a middle size and drops near the memory cap,
per-stage step costs, and measurement noise (2 %, heavier and heavy-tailed on some surfaces). Every
parameter is drawn at random per surface from the family's ranges, so nothing is tuned against one
fixed script.

The model, per rank (world = ranks of one experiment, P = parameters, fp16 with Adam):
- model states: params 2P, grads 2P, optimizer 12P, ZeRO-sharded over the world from stage 3, 2
  and 1 respectively, times `state_factor` (DeepSpeed's buffers and bucket copies, 1.0-1.3);
- reserved memory (what torch.cuda.max_memory_reserved reports) = states + `alloc_overhead` +
  `activation` * mbs, rounded up to 2 MiB; the device also holds `untracked` bytes the allocator
  never sees (CUDA context, NCCL buffers). A run needing more than the capacity fails: status
  `oom`; on surfaces whose script prints the CUDA OOM traceback and exits 1 (`failure_status`
  "crashed") the rank reads that traceback from stderr, so the record is `oom` too, with
  `oom_from: stderr` (workers.in_rank.oom);
- the profile run (stage 3, mbs 1) reports num_params and DeepSpeed's activation_mem_per_gpu,
  which is forward-only allocated memory: `profile_activation_fraction` (0.45-0.9) of the true
  per-sample growth; on `reports_peak` surfaces every run also reports its reserved peak;
- time of one micro-step = `micro_overhead` + stage's per-micro-step cost (ZeRO-3 gathers) +
  `sample_time` * mbs * shape(mbs), where shape grows as `fall_off` * ln(mbs / peak)^2 past the
  peak (mid-peak family), and time grows by up to `pressure_penalty` once memory use passes
  `pressure_threshold` of the device (allocator retries, smaller workspaces);
- one optimizer step = gas * micro-step + the stage's step cost: Adam over the states it owns
  (sharded from stage 1) plus communication (`comm` times a per-stage factor; ZeRO-3 always moves
  more than ZeRO-2); overlap_comm hides part of the communication, contiguous_gradients and the
  bucket sizes change it a little, from stage 2 (full mode's knobs);
- throughput = mbs * gas * world / step time, times (1 + noise), noise ~ N(0, 0.02 x f) drawn from a
  hash of the surface seed and the experiment name (a re-measurement has its own name, so its own
  draw; the same name in two searches gets the same draw). On half the surfaces every config has
  its own f, log-uniform in [0.5, `noise_spread`] (4) from a hash of (seed, stage, mbs, gas) (some
  configs far noisier than others), else f = 1; on half the surfaces a reading is a straggler's
  with probability `straggler_rate` (0.05-0.15): its step time times U(1.5, 2), and a lucky one
  with a third of that probability: its throughput times U(1.3, 1.8) (the config's other readings
  were slowed by a co-runner), drawn from a second hash of the seed and the name (so again one
  draw per reading). Heavy tails: one reading can beat a better config's.
- the user's config sets max_train_batch_size on half the surfaces only (most configs have none);
  30 % of the surfaces report no device peak (a script whose memory the allocator does not see).
  Each of these and the two noise models is a coin per surface (so about half, not exactly half,
  of one family's surfaces: 25 to 33 of seeds 0-59 have no limit).
The space is what DeepSpeed searches (`space`): with max_train_batch_size, every size that fits up
to mtbpg = max_train_batch_size / world, gas = mtbpg // mbs; without it, per stage every size up to
its largest that fits, T, with gas 1 and with gas T // mbs (DeepSpeed's mtbpg = T x the user's gas
1; T at most MBS_CAP). The optimum is the best noise-free throughput over that space at the default
knobs (more gas amortizes the step cost, so a gas-1 config never beats gas T // mbs at its size).

`with_buckets` adds what the states' factor only approximates: DeepSpeed's flat gradient bucket of
reduce_bucket_size elements (5e8, 1 GB in fp16), held whole at ZeRO-1/2/3 whatever the model's size
(`search_quality.py --buckets`).

The new attributes are drawn from a second random stream, so every parameter the surfaces had
before (those of `classic` surfaces, measured at commit c7e83a5) is unchanged; `classic` turns a surface back into that
earlier one (max_train_batch_size always set, Gaussian noise equal for every config, 85 % peaks).

Memory strategies, drawn from a third stream (so again nothing above moves) and honoured by
`reserved`, `throughput` and `run` from an experiment's config (its offload sections in
zero_optimization, and activation checkpointing from the strategies its autotuning section lists):
- `offload_optimizer` (stage >= 1): the optimizer states leave the device; the step's Adam runs on
  the CPU, `cpu_slowdown` (3-8) times the device's, over the rank's shard, plus `pcie_time` (the
  gradients down and the weights up: 0.2-0.6 of the step's communication);
- `offload_param` (stage 3): the parameters leave the device too; every micro-step fetches them,
  `param_fetch_time` (0.5-2 times the stage-3 gather);
- activation checkpointing: a sample holds `keep_share` (0.15-0.4) of its activations and each
  micro-step recomputes `recompute` (0.25-0.4) of its sample time.
The family "needs-strategy" (not in FAMILIES, so the other benches' default rows stay as they
were; `STRATEGY_FAMILIES`) allows all three in the user's config (`user_config`) and is drawn so
that a strategy matters: on half of it the model fits no stage without offload, on the other half
the activations leave room for a few samples only while the step's fixed costs still favour a
larger micro-batch, which checkpointing holds. Its optimum is taken over the strategies too.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Any, Mapping

GiB = 1 << 30
MiB = 1 << 20
FAMILIES = ("monotone", "mid-peak", "cliff", "small-model", "large-model")
#: Families whose user config allows memory strategies (asked for by name: module docstring).
STRATEGY_FAMILIES = ("needs-strategy",)
#: The memory strategies, as `autotuning.memory_strategies` names them.
STRATEGIES = ("offload_optimizer", "offload_param", "activation_checkpointing")
CAPACITIES_GIB = (16, 24, 40, 80)
WORLD = 2
MBS_CAP = 1024


@dataclass(frozen=True)
class Surface:
    """One synthetic script on one kind of device; see the module docstring for the model."""

    family: str
    seed: int
    capacity: int
    num_params: int
    state_factor: float
    activation: int
    profile_activation_fraction: float
    alloc_overhead: int
    untracked: int
    sample_time: float
    micro_overhead: float
    optimizer_time: float
    comm_time: float
    stage_comm: tuple[float, float, float, float]
    stage3_gather: float
    peak: float | None
    fall_off: float
    pressure_threshold: float
    pressure_penalty: float
    overlap_gain: float
    contiguous_gain: float
    max_train_batch_size: int | None
    failure_status: str = "oom"
    reports_peak: bool = True
    noise: float = 0.02
    world: int = WORLD
    drawn_max_train_batch_size: int = 0  #: the limit drawn for the classic surface (0: max_train_batch_size)
    drawn_reports_peak: bool = True  #: reports_peak of the classic surface
    noise_spread: float = 0.0  #: > 1: each config's noise is the base times log-uniform [0.5, this]
    straggler_rate: float = 0.0  #: share of readings slowed 1.5-2x (a third as many sped up 1.3-1.8x)
    bucket_bytes: int = 0  #: DeepSpeed's flat gradient bucket at ZeRO-1/2/3 (`with_buckets`; 0: none)
    allowed: tuple[str, ...] = ()  #: memory strategies the user's config allows (module docstring)
    keep_share: float = 0.3  #: share of a sample's activations a checkpointed run holds
    recompute: float = 0.3  #: share of the micro-step's sample time checkpointing adds
    cpu_slowdown: float = 5.0  #: CPU Adam over the device's, with offload_optimizer
    pcie_time: float = 0.0  #: seconds per step moving gradients down and weights up (offload_optimizer)
    param_fetch_time: float = 0.0  #: seconds per micro-step fetching parameters (offload_param)
    knobs: Mapping[str, Any] = field(default_factory=dict, compare=False)

    # ------------------------------------------------------------ memory

    def states(self, stage: int, strategy: tuple[str, ...] = ()) -> float:
        p = self.num_params
        params = 0 if "offload_param" in strategy else 2 * p / (self.world if stage >= 3 else 1)
        grads = 2 * p / (self.world if stage >= 2 else 1)
        optimizer = 0 if "offload_optimizer" in strategy else 12 * p / (self.world if stage >= 1 else 1)
        return (params + grads + optimizer) * self.state_factor

    def reserved(self, stage: int, mbs: int, strategy: tuple[str, ...] = ()) -> int:
        activation = self.activation * (self.keep_share if "activation_checkpointing" in strategy else 1)
        raw = self.states(stage, strategy) + self.alloc_overhead + activation * mbs + \
            (self.bucket_bytes if stage else 0)
        return int(math.ceil(raw / (2 * MiB)) * 2 * MiB)

    def fits(self, stage: int, mbs: int, strategy: tuple[str, ...] = ()) -> bool:
        return self.reserved(stage, mbs, strategy) + self.untracked <= self.capacity

    def max_fit(self, stage: int, strategy: tuple[str, ...] = ()) -> int:
        """The largest micro-batch that fits at `stage` (0: none), capped at MBS_CAP."""
        lo, hi = 0, MBS_CAP
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(stage, mid, strategy):
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def mtbpg(self) -> int | None:
        """Samples per GPU per step allowed by max_train_batch_size (None: no limit)."""
        return max(1, self.max_train_batch_size // self.world) if self.max_train_batch_size else None

    def space(self, stage: int, strategy: tuple[str, ...] = ()) -> list[tuple[int, int]]:
        """(mbs, gas) of every config DeepSpeed's fast mode can name at `stage` (module docstring)."""
        top = min(MBS_CAP, self.max_fit(stage, strategy))
        if self.mtbpg:
            return [(m, max(1, self.mtbpg // m)) for m in range(1, min(top, self.mtbpg) + 1)]
        return sorted({(m, 1) for m in range(1, top + 1)} | {(m, max(1, top // m)) for m in range(1, top + 1)})

    # ------------------------------------------------------------ speed

    def throughput(self, stage: int, mbs: int, gas: int, zero: Mapping[str, Any] | None = None,
                   checkpointing: bool = False) -> float:
        """Noise-free samples/s of the experiment (0 when it does not fit); offload from `zero`'s
        sections, checkpointing as given (module docstring)."""
        zero = zero or {}
        strategy = strategy_of(zero, checkpointing)
        if not self.fits(stage, mbs, strategy):
            return 0.0
        shape = 1.0
        if self.peak is not None and mbs > self.peak:
            shape += self.fall_off * math.log(mbs / self.peak) ** 2
        compute = self.sample_time * mbs * shape
        micro = self.micro_overhead + compute * (1 + self.recompute if checkpointing else 1)
        if stage >= 3:
            micro += self.stage3_gather + (self.param_fetch_time if "offload_param" in strategy else 0.0)
        if stage >= 2 and zero.get("contiguous_gradients"):
            micro *= 1 - self.contiguous_gain
        use = (self.reserved(stage, mbs, strategy) + self.untracked) / self.capacity
        if use > self.pressure_threshold:
            micro *= 1 + self.pressure_penalty * (use - self.pressure_threshold) / (1 - self.pressure_threshold)
        comm = self.comm_time * self.stage_comm[stage]
        if stage >= 2:
            if zero.get("overlap_comm"):
                comm *= 1 - self.overlap_gain
            bucket = float(zero.get("reduce_bucket_size", 5e8))
            comm *= 1 + 0.03 * abs(math.log10(bucket / 5e8))
        optimizer = self.optimizer_time / (self.world if stage >= 1 else 1)
        if "offload_optimizer" in strategy:
            optimizer = optimizer * self.cpu_slowdown + self.pcie_time
        step = gas * micro + optimizer + comm
        return mbs * gas * self.world / step

    def optimum(self, stages: tuple[int, ...] = (0, 1, 2, 3)) -> tuple[float, tuple[int, int, int]]:
        """(best noise-free throughput, (stage, mbs, gas)) over the fast-mode space, with every
        combination of the allowed strategies too (`allowed`; the first strategy-free config wins ties)."""
        best = (0.0, (0, 0, 0))
        for strategy in strategy_combinations(self.allowed):
            zero = {name: {"device": "cpu"} for name in strategy if name.startswith("offload_")}
            checkpointing = "activation_checkpointing" in strategy
            for stage in stages:
                if ("offload_optimizer" in strategy and stage < 1) or ("offload_param" in strategy and stage < 3):
                    continue
                for mbs, gas in self.space(stage, strategy):
                    value = self.throughput(stage, mbs, gas, zero, checkpointing)
                    if value > best[0]:
                        best = (value, (stage, mbs, gas))
        return best

    # ------------------------------------------------------------ records

    def run(self, name: str, ds_config: Mapping[str, Any], profile: bool = False) -> dict[str, Any]:
        """The record a real run of this script would leave (the fields the search reads)."""
        zero = ds_config.get("zero_optimization") or {}
        stage = int(zero.get("stage", 0))
        mbs = int(ds_config["train_micro_batch_size_per_gpu"])
        gas = int(ds_config.get("gradient_accumulation_steps", 1))
        checkpointing = checkpoints(ds_config)
        strategy = strategy_of(zero, checkpointing)
        record: dict[str, Any] = {"name": name, "ds_config": ds_config}
        if not self.fits(stage, mbs, strategy):
            record.update(status="oom", exit_code=1)
            if self.failure_status == "crashed":  # a traceback and exit 1, read by the rank from stderr
                record["oom_from"] = "stderr"
            return record
        record["status"] = "ok"
        if self.reports_peak:
            record["peak_device_bytes"] = self.reserved(stage, mbs, strategy)
        record["peak_rss_bytes"] = 3 * GiB + int(0.002 * self.num_params)  # host memory: flat in mbs
        if profile:
            record["metrics"] = {"num_params": self.num_params, "trainable_num_params": self.num_params,
                                 "activation_mem_per_gpu": int(self.activation * self.profile_activation_fraction)}
            return record
        value = self.throughput(stage, mbs, gas, zero, checkpointing) * self.reading_factor(name, stage, mbs, gas)
        step_s = mbs * gas * self.world / value
        record["metrics"] = {"throughput": value, "latency": step_s * 1e6, "FLOPS_per_gpu": value}
        return record

    def config_noise(self, stage: int, mbs: int, gas: int) -> float:
        """The standard deviation of this config's readings (a fraction)."""
        if self.noise_spread <= 1:
            return self.noise
        return self.noise * _log_uniform(_stream(f"{self.seed}:z{stage}:{mbs}:{gas}"), 0.5, self.noise_spread)

    def reading_factor(self, name: str, stage: int, mbs: int, gas: int) -> float:
        """One reading over the true throughput, drawn from the experiment's name (module docstring)."""
        factor = 1 + self.config_noise(stage, mbs, gas) * _gauss(self.seed, name)
        if self.straggler_rate:
            draw = _stream(f"{self.seed}:{name}:tail")
            tail = draw.random()
            if tail < self.straggler_rate:
                factor /= draw.uniform(1.5, 2.0)
            elif tail < self.straggler_rate * 4 / 3:
                factor *= draw.uniform(1.3, 1.8)
        return factor


def strategy_of(zero: Mapping[str, Any], checkpointing: bool) -> tuple[str, ...]:
    """The strategies a config runs with: its offload sections (device cpu or nvme) and checkpointing."""
    names = [name for name in STRATEGIES[:2]
             if isinstance(zero.get(name), Mapping) and zero[name].get("device") in ("cpu", "nvme")]
    return tuple(names + (["activation_checkpointing"] if checkpointing else []))


def checkpoints(ds_config: Mapping[str, Any]) -> bool:
    """Whether an experiment's config runs with activation checkpointing (its autotuning section lists it)."""
    listed = (ds_config.get("autotuning") or {}).get("memory_strategy") or ()
    return "activation_checkpointing" in listed


def strategy_combinations(allowed: tuple[str, ...]) -> list[tuple[str, ...]]:
    """No strategy, then every combination of the allowed ones."""
    return [()] + [tuple(n for n in STRATEGIES if n in chosen) for size in range(1, len(allowed) + 1)
                   for chosen in combinations(allowed, size)]


def _stream(key: str) -> random.Random:
    digest = hashlib.sha256(key.encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _gauss(seed: int, name: str) -> float:
    return _stream(f"{seed}:{name}").gauss(0.0, 1.0)


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def make_surface(family: str, seed: int) -> Surface:
    """One surface of `family`, every parameter drawn from `seed`."""
    if family not in FAMILIES + STRATEGY_FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES + STRATEGY_FAMILIES)}")
    rng = random.Random(f"{family}:{seed}")
    capacity = rng.choice(CAPACITIES_GIB) * GiB
    state_factor = rng.uniform(1.0, 1.3)
    alloc_overhead = int(rng.uniform(0.2, 1.5) * GiB)
    untracked = int(rng.uniform(0.5, 2.0) * GiB)
    free = capacity - alloc_overhead - untracked
    if family == "small-model":
        num_params = int(_log_uniform(rng, 10e6, 120e6))
    elif family == "needs-strategy":  # sized below, from the third stream
        num_params = int(_log_uniform(rng, 0.02, 0.5) * free / (16 * state_factor))
    elif family == "large-model":  # ZeRO-0 (16 B/param) does not fit or barely fits
        num_params = int(rng.uniform(0.85, 1.6) * free / (16 * state_factor))
        num_params = min(num_params, int(0.8 * free / (8 * state_factor)))  # ZeRO-3 still fits
    else:
        num_params = int(_log_uniform(rng, 0.02, 0.5) * free / (16 * state_factor))
    probe = Surface(family, seed, capacity, num_params, state_factor, 1, 1.0, alloc_overhead, untracked,
                    1.0, 1.0, 0.0, 0.0, (1, 1, 1, 1), 0.0, None, 0.0, 1.0, 0.0, 0.0, 0.0, 1)
    stage = next((s for s in range(4) if probe.states(s) + alloc_overhead + untracked < capacity * 0.97), 3)
    room = capacity - untracked - alloc_overhead - probe.states(stage)
    target_max = _log_uniform(rng, 6, 2000 if family == "small-model" else 800)
    activation = max(MiB, int(room / target_max))
    sample_time = 1e-3
    knee = _log_uniform(rng, 1, 48)  #: the micro-batch size where fixed per-step costs equal compute
    micro_overhead = knee * sample_time
    full_step = micro_overhead + sample_time * min(target_max, MBS_CAP)
    optimizer_time = _log_uniform(rng, 0.05, 1.0) * full_step
    comm_time = _log_uniform(rng, 0.05, 1.0) * full_step
    u1, u2 = rng.uniform(1.0, 1.3), rng.uniform(1.05, 1.5)
    stage_comm = (1.0, u1, u2, max(u2, rng.uniform(1.2, 1.8)))
    stage3_gather = rng.uniform(0.1, 0.5) * comm_time
    shape = family if family in ("monotone", "mid-peak", "cliff") else rng.choice(("monotone", "mid-peak", "cliff"))
    peak, fall_off = None, 0.0
    threshold, penalty = rng.uniform(0.93, 0.99), rng.uniform(0.0, 0.05)
    if shape == "mid-peak":
        peak = max(1.0, target_max * _log_uniform(rng, 0.03, 0.6))
        fall_off = rng.uniform(0.1, 0.6)
    elif shape == "cliff":
        threshold, penalty = rng.uniform(0.78, 0.92), rng.uniform(0.15, 0.5)
    mtbpg = 2 ** round(math.log2(max(2.0, min(target_max, MBS_CAP) * _log_uniform(rng, 0.5, 4))))
    profile_fraction, overlap_gain = rng.uniform(0.45, 0.9), rng.uniform(0.2, 0.6)
    contiguous_gain = rng.uniform(0.0, 0.04)
    failure_status, drawn_peak = rng.choice(("oom", "crashed")), rng.random() < 0.85
    extra = random.Random(f"{family}:{seed}:v2")  # new attributes: the draws above stay what they were
    bounded = extra.random() < 0.5
    reports_peak = drawn_peak and extra.random() >= 0.18  # 0.85 x 0.82: 30 % of surfaces show no peak
    noise_spread = 4.0 if extra.random() < 0.5 else 0.0
    straggler_rate = extra.uniform(0.05, 0.15) if extra.random() < 0.5 else 0.0
    strategic = random.Random(f"{family}:{seed}:v3")  # memory strategies: the draws above stay what they were
    keep_share, recompute = strategic.uniform(0.15, 0.4), strategic.uniform(0.25, 0.4)
    cpu_slowdown, pcie_time = strategic.uniform(3.0, 8.0), strategic.uniform(0.2, 0.6) * comm_time
    param_fetch_time = strategic.uniform(0.5, 2.0) * stage3_gather
    allowed: tuple[str, ...] = ()
    if family == "needs-strategy":
        allowed = STRATEGIES
        if strategic.random() < 0.5:  # no stage holds the states: ZeRO-3's 16 B/param over WORLD ranks exceed the room
            num_params = int(strategic.uniform(1.05, 1.4) * (free - 64 * MiB) * WORLD / (16 * state_factor))
            activation = max(MiB, int(strategic.uniform(0.002, 0.02) * free))
        else:  # a few samples fit, and the step's fixed costs favour more: checkpointing's larger batch
            room = free - replace(probe, num_params=num_params).states(1)
            activation = max(MiB, int(room / strategic.uniform(2.5, 6)))
            micro_overhead = _log_uniform(strategic, 8, 48) * sample_time
        peak, fall_off, threshold, penalty = None, 0.0, strategic.uniform(0.93, 0.99), strategic.uniform(0.0, 0.05)
    return Surface(
        family=family, seed=seed, capacity=capacity, num_params=num_params, state_factor=state_factor,
        activation=activation, profile_activation_fraction=profile_fraction,
        alloc_overhead=alloc_overhead, untracked=untracked, sample_time=sample_time,
        micro_overhead=micro_overhead, optimizer_time=optimizer_time, comm_time=comm_time,
        stage_comm=stage_comm, stage3_gather=stage3_gather, peak=peak, fall_off=fall_off,
        pressure_threshold=threshold, pressure_penalty=penalty, overlap_gain=overlap_gain,
        contiguous_gain=contiguous_gain, max_train_batch_size=mtbpg * WORLD if bounded else None,
        failure_status=failure_status, reports_peak=reports_peak, drawn_max_train_batch_size=mtbpg * WORLD,
        drawn_reports_peak=drawn_peak, noise_spread=noise_spread, straggler_rate=straggler_rate,
        allowed=allowed, keep_share=keep_share, recompute=recompute, cpu_slowdown=cpu_slowdown, pcie_time=pcie_time,
        param_fetch_time=param_fetch_time)


def classic(surface: Surface) -> Surface:
    """The surface as the bench drew it before: max_train_batch_size always set, Gaussian noise
    equal for every config, a device peak on 85 % of surfaces (for before/after figures)."""
    return replace(surface, max_train_batch_size=surface.drawn_max_train_batch_size or surface.max_train_batch_size,
                   reports_peak=surface.drawn_reports_peak, noise_spread=0.0, straggler_rate=0.0)


#: DeepSpeed's default reduce_bucket_size (5e8 elements) in fp16: the bucket ZeRO-1/2 allocate at each
#: backward (one, overlap_comm being off by default there) and ZeRO-3 when its optimizer is built.
DEEPSPEED_BUCKET_BYTES = 10**9


def with_buckets(surface: Surface) -> Surface:
    """The surface with DeepSpeed's flat gradient bucket held at ZeRO-1/2/3 (issue 21 item 15), the
    fixed allocation `state_factor` only approximates in proportion to the model; a surface on which
    no stage fits any more (a large model on a small device) is left without it."""
    bucketed = replace(surface, bucket_bytes=DEEPSPEED_BUCKET_BYTES)
    return bucketed if any(bucketed.max_fit(stage) for stage in range(4)) else surface


def user_config(surface: Surface) -> dict[str, Any]:
    """The DeepSpeed config a user would tune this script with: fast mode, every stage, fp16, and
    max_train_batch_size only where the surface has one."""
    autotuning: dict[str, Any] = {"enabled": True, "fast": True}
    if surface.allowed:
        autotuning["memory_strategies"] = list(surface.allowed)
        autotuning["arg_mappings"] = {"activation_checkpointing": "--gradient_checkpointing"}
    if surface.max_train_batch_size:
        autotuning["max_train_batch_size"] = surface.max_train_batch_size
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "fp16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": "all"},
        "autotuning": autotuning,
    }


def at_world(surface: Surface, world: int) -> Surface:
    """The same script on `world` ranks per experiment: the same samples per GPU per step (the
    limit scaled with the world), the states sharded over `world`, and the gradients' communication
    scaled by a ring all-reduce's 2 (world - 1) / world against the 2 ranks it was drawn for (none
    on one rank). Real jobs run 8 ranks per node and more; ZeRO-3's sharding frees more there."""
    ring = 2 * (world - 1) / world
    return replace(surface, world=world, comm_time=surface.comm_time * ring,
                   stage3_gather=surface.stage3_gather * ring,
                   max_train_batch_size=surface.mtbpg * world if surface.max_train_batch_size else None,
                   drawn_max_train_batch_size=surface.drawn_max_train_batch_size // WORLD * world)
