"""Held-out search bench: our search, DeepSpeed's fast-mode replay and every-config-once over script
families written apart from bench/surfaces.py, so the search is measured on scripts it was not tuned on.

Why: the search was tuned on bench/search_quality.py's surfaces, so their figures flatter it. Here a
step's time is built bottom-up from where a DeepSpeed step spends it: transformer FLOPs over the
tensor peak at an efficiency that saturates in the GEMM rows (mbs x seq) and loses tile and wave
quantization and misaligned rows (throughput moves in steps, fast at multiples of 8); ring collectives
over NVLink, PCIe or, for 2 nodes x 8, a slower NIC, once per optimizer step at ZeRO-0/1 (gas amortizes
them), every micro-step at ZeRO-2/3, hidden by ZeRO-3's prefetch and overlap_comm only behind long
enough compute (large micro-batches) and never for free; Adam at HBM speed over the owned shard; a
cost once the allocator retries near the cap. Memory: fp16 (2/2/16 bytes per parameter), bf16 (2/4/12)
or fp32 (4/4/8) states sharded by stage, buckets, Korthikanti activations (flash attention,
checkpointing, logits), fragmentation, a per-size allocator jitter (a few sizes below the top fail),
CUDA context and NCCL outside the allocator; the profile reports the forward's saved activations only.
Noise: each search launches in order on its own copy of one drifting machine; a window of launches
shares a slowdown (AR(1)), each reading has its own jitter, a straggler (any rank may stall the step)
slows it 1.3-2.5x, a lucky one speeds it 1.1-1.4x.
Families (every constant drawn per seed): `tile-steps` ViT/CLIP-like models (odd token counts, small
GEMMs) on 4-8 GPUs; `comm-bound` GPT-like models on 8-16 PCIe GPUs or 2 nodes x 8; `zero3-scale` 2-15 B
parameters on 8-16 large GPUs; `drifting` mid-size models anywhere under heavy drift and stragglers;
`precision` bf16 or fp32 states (DeepSpeed's estimate assumes fp16) and an earlier allocator cliff.
Fraction = the named config's noise-free throughput over the best in DeepSpeed's fast-mode space
(`Script.space`). "aborted": the search raised SearchAborted/NoStageFits or named no config.

    .venv/bin/python bench/heldout.py [--surfaces 40] [--seed 0] [--family drifting]
"""
from __future__ import annotations

import argparse
import hashlib
import math
import random
import statistics
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.deepspeed_replay import DeepSpeedFastMode  # noqa: E402
from bench.stats import BELOW, below, quantile  # noqa: E402
from scheduler.search.fast_search import PROFILE, SearchSettings, fast_search  # noqa: E402
from scheduler.search.phases import Phase, drive  # noqa: E402
from scheduler.search.ranking import best  # noqa: E402
from scheduler.search.session import SearchAborted  # noqa: E402

#: bytes; DeepSpeed's micro-batch cap, reduce_bucket_size and stage3_prefetch_bucket_size (elements)
GiB, MiB, MBS_CAP, BUCKET, PREFETCH = 1 << 30, 1 << 20, 1024, 5e8, 5e7
FAMILIES = ("tile-steps", "comm-bound", "zero3-scale", "drifting", "precision")
STATE_BYTES = {"fp16": (2, 2, 16), "bf16": (2, 4, 12), "fp32": (4, 4, 8)}  #: params, grads, optimizer
#: A device kind: torch's total memory, dense fp16/bf16 and TF32 TFLOPS, HBM bytes/s, SMs, the
#: in-node all-reduce bus bytes/s (0: PCIe only) and bf16 support (public spec sheets).
Gpu = NamedTuple("Gpu", [("name", str), ("memory", int), ("tensor_tflops", float), ("tf32_tflops", float),
                         ("hbm", float), ("sms", int), ("nvlink", float), ("bf16", bool)])
GPUS = {g.name: g for g in (
    Gpu("V100-16", 16_945_709_056, 125, 15.7, 0.9e12, 80, 130e9, False),
    Gpu("V100-32", 34_089_926_656, 125, 15.7, 0.9e12, 80, 130e9, False),
    Gpu("A10G", 23_836_098_560, 70, 35, 0.6e12, 80, 0.0, True),
    Gpu("L4", 23_580_639_232, 121, 60, 0.3e12, 58, 0.0, True),
    Gpu("A100-40", 42_505_273_344, 312, 156, 1.55e12, 108, 230e9, True),
    Gpu("A100-80", 85_031_714_816, 312, 156, 2.0e12, 108, 230e9, True),
    Gpu("H100", 85_520_809_984, 989, 495, 3.35e12, 132, 370e9, True))}


@dataclass(frozen=True)
class Script:
    """One held-out script on one machine (module docstring); `k`: `_model`'s constants, `n`: the noise's."""

    family: str
    seed: int
    gpu: Gpu
    nodes: int
    per_node: int
    world: int
    bus: float  #: ring bus bandwidth (bytes/s): NVLink, PCIe or the inter-node NIC
    alpha: float  #: seconds per ring hop
    untracked: int  #: CUDA context and NCCL buffers, never in the allocator's peak
    precision: str
    layers: int
    hidden: int
    seq: int
    vocab: int
    params: int
    token_logits: bool  #: a language model (logits per token) or a classifier (per sample)
    flash: bool
    checkpoint: bool  #: activation checkpointing: a layer's input kept, the forward run twice
    k: Mapping[str, float]
    max_train_batch_size: int | None
    reports_peak: bool
    failure_status: str  #: "crashed": the OOM traceback is read from stderr
    n: Mapping[str, float]

    def activation(self) -> tuple[float, float]:
        """(bytes per sample the step holds at its peak, bytes the profile's forward saves)."""
        element = 4 if self.precision == "fp32" else 2
        layer = self.seq * self.hidden * (34 + (0 if self.flash else 5 * self.seq / 64)) * element / 2  # a = h / 64
        saved = self.seq * self.hidden * element if self.checkpoint else layer
        rows = self.seq if self.token_logits else 1
        forward = self.layers * saved + rows * self.vocab * (element + 4)  # logits and their fp32 upcast
        return forward + rows * self.vocab * 4 + 1.5 * layer, forward  # + the logits' gradient, a layer's backward

    def reserved(self, stage: int, mbs: int, forward_only: bool = False) -> int:
        """The allocator's peak: states, buffers (2 MiB blocks) and activations (20 MiB segments)."""
        pb, gb, ob = STATE_BYTES[self.precision]
        states = sum(b / (self.world if stage >= s else 1) for b, s in ((pb, 3), (gb, 2), (ob, 1))) * self.params
        buffers = (2 * self.params / self.layers + PREFETCH) * pb if stage >= 3 else min(self.params, BUCKET) * gb
        fixed = math.ceil((states + buffers + self.k["workspace"]) / (2 * MiB)) * 2 * MiB
        return fixed + math.ceil(self.activation()[forward_only] * mbs * self.k["frag"] / (20 * MiB)) * 20 * MiB

    @cached_property
    def jitter(self) -> list[list[float]]:
        """Per stage and size, the allocator's extra bytes (block splitting), drawn once per script."""
        rng = _stream(f"{self.seed}:{self.family}:jag")
        return [[self.k["jag"] * self.gpu.memory * rng.random() for _ in range(MBS_CAP + 1)] for _ in range(4)]

    def runs(self, stage: int, mbs: int) -> bool:
        jitter = self.jitter[stage][min(mbs, MBS_CAP)]
        return self.reserved(stage, mbs) + self.untracked + jitter <= self.gpu.memory

    def space(self, stage: int) -> list[tuple[int, int]]:
        """(mbs, gas) of every config DeepSpeed's fast mode can name at `stage` (module docstring)."""
        mtbpg = max(1, self.max_train_batch_size // self.world) if self.max_train_batch_size else None
        sizes = [m for m in range(1, min(MBS_CAP, mtbpg or MBS_CAP) + 1) if self.runs(stage, m)]
        if mtbpg:
            return [(m, max(1, mtbpg // m)) for m in sizes]
        return sorted({(m, 1) for m in sizes} | {(m, max(1, max(sizes) // m)) for m in sizes})

    def flops_per_sample(self) -> float:
        """Forward and backward (and the recomputed forward under checkpointing) of one sample."""
        return (4 if self.checkpoint else 3) * self.seq * (2 * self.params + 4 * self.layers * self.seq * self.hidden)

    def compute(self, mbs: int) -> float:
        """Seconds of forward and backward for one micro-batch, communication aside."""
        k, rows, tile = self.k, mbs * self.seq, int(self.k["tile"])
        tiles_r, tiles_c = math.ceil(rows / tile), math.ceil(4 * self.hidden / tile)
        waves = math.ceil(tiles_r * tiles_c / self.gpu.sms)
        quantized = tiles_r * tiles_c / (waves * self.gpu.sms) * rows / (tiles_r * tile)
        eff = k["mfu"] * rows / (rows + k["half_rows"]) * (1 - k["wave_weight"] * (1 - quantized))
        if rows % (4 if self.precision == "fp32" else 8):  # tensor-core kernels want aligned rows
            eff *= k["misalign"] if rows % 2 else math.sqrt(k["misalign"])
        peak = (self.gpu.tf32_tflops if self.precision == "fp32" else self.gpu.tensor_tflops) * 1e12
        elementwise = 3 * self.activation()[1] * mbs / self.gpu.hbm
        return mbs * self.flops_per_sample() / (peak * eff) + elementwise + self.layers * k["layer_cost"]

    def ring(self, nbytes: float, passes: int, calls: int) -> float:
        """A ring collective: `passes` 1 (reduce-scatter, all-gather) or 2 (all-reduce)."""
        return passes * (self.world - 1) * (nbytes / self.world / self.bus + calls * self.alpha)

    def behind(self, comm: float, compute: float, share: float) -> float:
        """Overlapped communication's cost: what `share` of `compute` cannot hide, plus its drag on compute."""
        hidden = min(comm, share * compute)
        return comm - hidden + self.k["interference"] * hidden

    def step_time(self, stage: int, mbs: int, gas: int, zero: Mapping[str, Any]) -> float:
        pb, gb, ob = STATE_BYTES[self.precision]
        k, p, compute, buckets = self.k, self.params, self.compute(mbs), math.ceil(self.params / BUCKET)
        overlap = bool(zero.get("overlap_comm", stage >= 3))  # DeepSpeed's default: on at ZeRO-3 only
        micro, step = k["micro_fixed"] + compute, k["step_fixed"]
        if stage <= 1:  # reduced once, at the accumulation boundary
            step += self.ring(p * gb, 2, buckets) if stage == 0 else \
                self.ring(p * gb, 1, buckets) + self.ring(p * pb, 1, buckets)
        elif stage == 2:  # reduce-scattered at every micro-step, gathered after the update
            reduce = self.ring(p * gb, 1, buckets)
            micro += self.behind(reduce, compute, k["overlap_eff"] * 2 / 3) if overlap else reduce
            step += self.ring(p * pb, 1, buckets)
        else:  # every layer gathered in the forward and the backward, prefetched; 8 modules' hooks a layer
            gathers, reduce = 2 * self.ring(p * pb, 1, self.layers), self.ring(p * gb, 1, self.layers)
            shared = gathers + (reduce if overlap else 0.0)  # one link: overlapped traffic shares one window
            micro += max(gathers / self.layers, self.behind(shared, compute, k["prefetch_eff"]))
            micro += (0.0 if overlap else reduce) + 16 * self.layers * k["hook_cost"]
        owned = p / (self.world if stage >= 1 else 1)
        step += owned * (2 * ob + gb + pb) / self.gpu.hbm  # Adam reads and writes its states
        total = gas * micro + step
        if self.reserved(stage, mbs) + self.untracked > (1 - k["retry_margin"]) * self.gpu.memory:
            total *= 1 + k["retry_cost"]  # cudaMalloc retries: the cache is flushed every step
        return total

    def throughput(self, stage: int, mbs: int, gas: int, zero: Mapping[str, Any] | None = None) -> float:
        return mbs * gas * self.world / self.step_time(stage, mbs, gas, zero or {}) if self.runs(stage, mbs) else 0.0

    @cached_property
    def optimum(self) -> float:
        return max((self.throughput(s, m, g) for s in range(4) for m, g in self.space(s)), default=0.0)

    def user_config(self) -> dict[str, Any]:
        """The config a user tunes with: fast mode, every stage, the script's precision."""
        limit = {"max_train_batch_size": self.max_train_batch_size} if self.max_train_batch_size else {}
        precision = {self.precision: {"enabled": True}} if self.precision != "fp32" else {}
        return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, **precision,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": "all"},
                "autotuning": {"enabled": True, "fast": True, **limit}}


def _parse(config: Mapping[str, Any]) -> tuple[int, int, int, Mapping[str, Any]]:
    zero = config.get("zero_optimization") or {}
    return (int(zero.get("stage", 0)), int(config["train_micro_batch_size_per_gpu"]),
            int(config.get("gradient_accumulation_steps", 1)), zero)


def _stream(key: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))


class Machine:
    """One search's launches, in order, on a drifting machine (module docstring): stateful on purpose,
    since a shared machine's slowdown lasts for a window of launches whatever they are."""

    def __init__(self, script: Script) -> None:
        self.script, self.launches, self.windows, self._walk = script, 0, [], _stream(f"{script.seed}:{script.family}")

    def _window(self, index: int) -> float:
        n = self.script.n
        while len(self.windows) <= index:  # a stationary AR(1) walk of the log slowdown
            shock, rho = self._walk.gauss(0.0, n["drift"]), n["rho"]
            level = rho * math.log(self.windows[-1]) + shock * math.sqrt(1 - rho ** 2) if self.windows else shock
            self.windows.append(math.exp(level))
        return self.windows[index]

    def factor(self, launch: int, name: str) -> float:
        s, n = self.script, self.script.n
        draw = _stream(f"{s.family}:{s.seed}:{launch}:{name}")
        value = self._window(launch // int(n["window"])) * (1 + n["noise"] * draw.gauss(0.0, 1.0))
        tail, straggle = draw.random(), 1 - (1 - n["straggle_q"]) ** s.world
        if tail < straggle:  # a straggler's step
            return value / draw.uniform(1.3, 2.5)
        return value * draw.uniform(1.1, 1.4) if tail < straggle * (1 + n["lucky_share"]) else value

    def run(self, name: str, ds_config: Mapping[str, Any], profile: bool = False) -> dict[str, Any]:
        """The record a real run leaves (the fields bench/surfaces.py's Surface.run leaves)."""
        s, launch, (stage, mbs, gas, zero) = self.script, self.launches, _parse(ds_config)
        self.launches += 1
        record: dict[str, Any] = {"name": name, "ds_config": ds_config}
        if not s.runs(stage, mbs):
            crashed = {"oom_from": "stderr"} if s.failure_status == "crashed" else {}
            return {**record, "status": "oom", "exit_code": 1, **crashed}
        record.update(status="ok", peak_rss_bytes=3 * GiB + int(0.004 * s.params))
        if s.reports_peak:
            record["peak_device_bytes"] = s.reserved(stage, mbs, forward_only=profile)
        if profile:
            return {**record, "metrics": {"num_params": s.params, "trainable_num_params": s.params,
                                          "activation_mem_per_gpu": int(s.activation()[1])}}
        value = s.throughput(stage, mbs, gas, zero) * self.factor(launch, name)
        step = mbs * gas * s.world / value
        return {**record, "metrics": {"throughput": value, "latency": step * 1e6,
                                      "FLOPS_per_gpu": s.flops_per_sample() * mbs * gas / step}}


def _hardware(rng: random.Random, family: str) -> dict[str, Any]:
    """The machine and how it measures: device kind, topology (4, 8, 16 on one node, or 2 nodes x 8),
    links, the user's limit, jitter, drift and tails (heavy on the drifting family)."""
    kinds = {"tile-steps": ("V100-32", "A10G", "L4", "A100-40", "A100-80", "H100"),
             "comm-bound": ("A10G", "L4", "V100-32", "A100-40"),
             "zero3-scale": ("A100-40", "A100-80", "H100")}.get(family, tuple(GPUS))
    shapes = {"tile-steps": ((1, 4), (1, 8)), "comm-bound": ((1, 8), (1, 16), (2, 8)),
              "zero3-scale": ((1, 8), (1, 16), (2, 8)), "precision": ((1, 4), (1, 8), (2, 8))}
    gpu = GPUS[rng.choice(kinds)]
    nodes, per_node = rng.choice(shapes.get(family, ((1, 4), (1, 8), (1, 16), (2, 8))))
    pcie = gpu.nvlink == 0 or (family == "comm-bound" and rng.random() < 0.5)
    bus = rng.uniform(8e9, 20e9) if pcie else gpu.nvlink * rng.uniform(0.7, 1.0)
    alpha = rng.uniform(3e-6, 8e-6)
    if nodes > 1:  # the ring crosses a 100-400 Gb/s NIC twice
        bus, alpha = min(bus, rng.uniform(10e9, 48e9)), rng.uniform(10e-6, 25e-6)
    nccl = rng.uniform(0.4, 0.7) if nodes * per_node <= 8 else rng.uniform(0.7, 1.6)
    untracked = int((rng.uniform(0.3, 0.7) + nccl) * GiB)  # the CUDA context and NCCL's buffers
    limits = {"tile-steps": (9, 13), "comm-bound": (7, 11), "zero3-scale": (7, 10)}.get(family, (7, 12))
    mtbs = max(nodes * per_node, 2 ** rng.randint(*limits)) if rng.random() < 0.5 else None
    heavy = family == "drifting"
    n = dict(noise=rng.uniform(0.015, 0.03) if heavy else rng.uniform(0.008, 0.02),
             drift=rng.uniform(0.03, 0.08) if heavy else rng.uniform(0.005, 0.02),
             window=rng.randint(2, 6) if heavy else rng.randint(3, 8),
             rho=rng.uniform(0.5, 0.9) if heavy else rng.uniform(0.3, 0.8),
             straggle_q=rng.uniform(0.003, 0.015) if heavy else rng.uniform(0.0005, 0.004),
             lucky_share=rng.uniform(0.3, 0.5) if heavy else rng.uniform(0.2, 0.4))
    return dict(gpu=gpu, nodes=nodes, per_node=per_node, world=nodes * per_node, bus=bus, alpha=alpha,
                untracked=untracked, max_train_batch_size=mtbs, reports_peak=rng.random() < 0.7,
                failure_status=rng.choice(("oom", "crashed")), n=n)


def _model(rng: random.Random, family: str, gpu: Gpu) -> dict[str, Any]:
    """The network, its precision and how its kernels, allocator and engine behave on this device."""
    shapes = {  # hidden sizes, depths, token counts, vocabularies (tile-steps: ViT/CLIP-like classifiers)
        "tile-steps": ((384, 512, 768, 1024, 1280), (6, 24), (50, 77, 197, 257, 577), (1000, 11821, 21843)),
        "zero3-scale": ((2560, 4096, 5120), (24, 48), (1024, 2048, 4096), (32000, 50257, 128256))}
    hiddens, depth, seqs, vocabs = shapes.get(family, ((768, 1024, 1536, 2048, 2560), (12, 32),
                                                       (128, 256, 512, 1024, 2048), (30522, 32000, 50257)))
    hidden, layers, seq, vocab = rng.choice(hiddens), rng.randint(*depth), rng.choice(seqs), rng.choice(vocabs)
    choices = ("bf16", "fp32") if family == "precision" else ("fp16", "bf16")
    precision = rng.choice(choices) if gpu.bf16 else ("fp32" if family == "precision" else "fp16")  # V100
    strong, big, tight = family == "tile-steps", family == "zero3-scale", family == "precision"  # tight: retries
    k = dict(mfu=rng.uniform(0.35, 0.6), half_rows=rng.uniform(64, 512) * 2048 / hidden,
             wave_weight=rng.uniform(0.4, 0.9) if strong else rng.uniform(0.1, 0.4), tile=rng.choice((128, 256)),
             misalign=rng.uniform(0.5, 0.85) if strong else rng.uniform(0.88, 0.98),
             layer_cost=rng.uniform(0.08e-3, 0.25e-3), micro_fixed=rng.uniform(3e-3, 15e-3),
             step_fixed=rng.uniform(5e-3, 40e-3), hook_cost=rng.uniform(30e-6, 200e-6),
             prefetch_eff=rng.uniform(0.4, 0.85), overlap_eff=rng.uniform(0.4, 0.9),
             interference=rng.uniform(0.1, 0.35), frag=rng.uniform(1.02, 1.15), jag=rng.uniform(0.0, 0.006),
             workspace=rng.uniform(64, 512) * MiB, retry_margin=rng.uniform(0.04, 0.08) if tight else
             rng.uniform(0.01, 0.04), retry_cost=rng.uniform(0.15, 0.5) if tight else rng.uniform(0.05, 0.25))
    return dict(precision=precision, layers=layers, hidden=hidden, seq=seq, vocab=vocab, token_logits=not strong,
                params=12 * layers * hidden ** 2 + vocab * hidden,
                flash=rng.random() < (0.8 if big else 0.6),
                checkpoint=not strong and rng.random() < (0.8 if big else 0.3), k=k)


def make_script(family: str, seed: int) -> Script:
    """One script of `family`, drawn from `seed`; drawn again until the profile run (ZeRO-3, mbs 1) runs."""
    for attempt in range(200):
        rng = random.Random(f"heldout:{family}:{seed}:{attempt}")
        hardware = _hardware(rng, family)
        script = Script(family=family, seed=seed, **hardware, **_model(rng, family, hardware["gpu"]))
        if script.runs(3, 1):
            return script
    raise RuntimeError(f"{family} seed {seed}: no draw fits")


#: One search on one script: its fraction of the optimum (None: aborted), launches and failed launches.
Outcome = NamedTuple("Outcome", [("fraction", "float | None"), ("launches", int), ("failed", int)])


def _outcome(script: Script, launches: list[dict[str, Any]], config: Mapping[str, Any] | None) -> Outcome:
    fraction = script.throughput(*_parse(config)) / script.optimum if config else None
    return Outcome(fraction, len(launches), sum(r.get("status") != "ok" for r in launches))


def ours(script: Script) -> Outcome:
    """Our search as the control worker drives it (search_quality.ours' settings, this topology)."""
    settings = SearchSettings(
        ds_config=script.user_config(), capacity_bytes=script.gpu.memory, stages=(0, 1, 2, 3),
        num_nodes=script.nodes, num_gpus=script.per_node, max_train_batch_size=script.max_train_batch_size,
        peak_memory_key="peak_device_bytes", host_memory=False, concurrency=1)
    machine, launches = Machine(script), []

    def run_phase(phase: Phase) -> dict[str, dict[str, Any]]:
        fresh = [machine.run(exp.name, exp.ds_config, profile=exp.name == PROFILE) for exp in phase.experiments]
        launches.extend(fresh)
        return {record["name"]: record for record in fresh}

    try:
        drive(fast_search(settings), run_phase)
    except SearchAborted:  # NoStageFits included
        return _outcome(script, launches, None)
    winner = best([r for r in launches if r.get("name") != PROFILE], "throughput", True)
    return _outcome(script, launches, winner["ds_config"] if winner else None)


def deepspeed(script: Script) -> Outcome:
    result = DeepSpeedFastMode(script.user_config(), Machine(script).run, capacity=script.gpu.memory,
                               world=script.world).tune()
    return _outcome(script, result.launches, result.best_config)


def every_config_once(script: Script) -> Outcome:
    """Every config of the space measured once on the same drifting machine, the best reading named."""
    machine, user = Machine(script), script.user_config()
    configs = [(s, m, g) for s in range(4) for m, g in script.space(s)]
    launches = [machine.run(f"z{s}_gas{g}_tmbspg{m}", {**user, "zero_optimization": {"stage": s},
                "train_micro_batch_size_per_gpu": m, "gradient_accumulation_steps": g}) for s, m, g in configs]
    winner = max(launches, key=lambda r: r["metrics"]["throughput"], default=None)
    return _outcome(script, launches, winner["ds_config"] if winner else None)


def _row(family: str, label: str, outcomes: list[Outcome], reference: list[Outcome]) -> None:
    done = [o for o in outcomes if o.fraction is not None]
    fractions = [o.fraction for o in done] or [0.0]
    launches, failed = [o.launches for o in outcomes], [o.failed for o in outcomes]
    print(f"{family:<13}{label:<11}{statistics.median(fractions):>9.3f}{quantile(fractions, 0.1):>9.3f}"
          f"{sum(f >= 0.97 for f in fractions) / len(outcomes):>8.0%}{statistics.median(launches):>8.1f}"
          f"{quantile(launches, 0.9):>8.0f}{statistics.median(failed):>8.1f}{quantile(failed, 0.9):>8.0f}"
          f"{sum(f < 0.9 for f in fractions) if done else 0:>7}{len(outcomes) - len(done):>9}"
          f"{below([o.fraction or 0.0 for o in outcomes], [r.fraction or 0.0 for r in reference]):>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--surfaces", type=int, default=40, help="scripts per family (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="first script seed of every family")
    parser.add_argument("--family", choices=FAMILIES, action="append", help="only these families")
    args = parser.parse_args()
    print(f"HELD-OUT SEARCH BENCH: {args.surfaces} scripts per family from seed {args.seed}; launches include "
          f"the profile run; >=0.97 and <0.9 count searches, aborted ones not at >=0.97; below: picks below "
          f"{BELOW:g}x the other's on the same script (DeepSpeed's replay's; for it, ours)")
    print(f"{'family':<13}{'search':<11}{'frac med':>9}{'frac p10':>9}{'>=0.97':>8}{'launch':>8}{'l p90':>8}"
          f"{'failed':>8}{'f p90':>8}{'<0.9':>7}{'aborted':>9}{'below':>6}")
    totals: dict[str, list[Outcome]] = {}
    for family in args.family or FAMILIES:
        scripts = [make_script(family, seed) for seed in range(args.seed, args.seed + args.surfaces)]
        rows = {label: [search(script) for script in scripts]
                for label, search in (("ours", ours), ("DeepSpeed", deepspeed), ("all once", every_config_once))}
        for label, outcomes in rows.items():
            totals.setdefault(label, []).extend(outcomes)
            _row(family, label, outcomes, rows["ours" if label == "DeepSpeed" else "DeepSpeed"])
    for label, outcomes in totals.items():
        _row("all", label, outcomes, totals["ours" if label == "DeepSpeed" else "DeepSpeed"])


if __name__ == "__main__":
    main()
