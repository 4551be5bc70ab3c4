"""Both searches replayed on a real trace (bench/collect_traces.py): real shapes, real noise, in seconds.

Why: bench/search_quality.py's surfaces are a model we wrote; a trace is what examples/train_gpt.py
did on this machine, window by window. Each replay runs our sampled search (`scheduler.search.fast_search`,
as the control worker drives it) and DeepSpeed 0.19's fast mode (`bench.deepspeed_replay`) on the
trace's config (bench/vs_deepspeed.py's: fast mode, the traced ZeRO stages, micro-batch up to the
traced top, no max_train_batch_size). Every launch of a config draws one of that config's recorded
windows at random (seeded by the replay's seed and the experiment's name, so a re-measurement draws
its own): ours reads the window's mean step time as throughput and its step times (as
`workers.in_rank.entry` gives them), DeepSpeed reads its engine metric (the window's last step). A config
the trace lacks ends that replay as "untraced" (counted, never guessed). Under `--capacity-gib` a
config whose traced peak (host memory, the largest of its launches) is above it runs out of memory,
as under a slot's cap, and is no candidate for the optimum. A trace collected with checkpointing
(`collect_traces.py --checkpointing`) allows that strategy in the user's config: our search may
run the script's switch where memory stops it; DeepSpeed's tunes no strategy.

A config's true value is the mean throughput over all its recorded windows; the optimum the best
such mean. A replay's pick is right (issue 32's answer 3: judged against the trace as it is, with its
own uncertainty) when its mean is within 3 % of the best's mean or inside the best config's 95 %
interval (`Trace.interval`: its mean +- 1.96 standard errors over its windows; `right`). Printed
per search: the share of replays whose pick is right, the share within 3 % alone, the median and
10th percentile of the fraction of the optimum, the median launches (profile run and
re-measurements included), and the configs named most often; the same for every config read once
(`every_config_once`), the reference of what the trace's noise lets single readings tell apart.

    .venv/bin/python bench/trace_replay.py [bench/traces/train_gpt.json] [--replays 200] [--seed 0] [--capacity-gib 24]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.collect_traces import CHECKPOINTING  # noqa: E402
from bench.deepspeed_replay import DeepSpeedFastMode  # noqa: E402
from bench.stats import quantile  # noqa: E402
from scheduler.inputs.memory_strategies import MemoryStrategyKeys  # noqa: E402
from scheduler.search.fast_search import PROFILE, SearchSettings, fast_search  # noqa: E402
from scheduler.search.phases import Phase, drive  # noqa: E402
from scheduler.search.ranking import best  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
#: A named config within this fraction of the optimum counts as a good pick (issue 20's goal).
GOOD = 0.97
#: A pick inside the best config's interval of this many standard errors of its mean (95 %) is right too.
INTERVAL_Z = 1.96


class Untraced(Exception):
    """A search asked for a config the trace does not hold."""


Key = tuple[int, int, int, bool]  #: (stage, mbs, gas, with activation checkpointing)


def key_of(config: Mapping[str, Any]) -> Key:
    """A traced config's key (bench/collect_traces.py's "strategy" lists checkpointing)."""
    return (int(config["stage"]), int(config["mbs"]), int(config["gas"]), CHECKPOINTING in config.get("strategy", ()))


@dataclass(frozen=True)
class Trace:
    """One collected trace: every window of every config, and the profile run. `capacity`: the slot
    memory a replay runs under; a config whose traced peak is above it runs out of memory there and
    is no candidate for the optimum (None: the machine's own, where every traced config ran)."""

    data: Mapping[str, Any]
    capacity: int | None = None

    @property
    def world(self) -> int:
        return int(self.data["world"])

    @cached_property
    def configs(self) -> dict[Key, Mapping[str, Any]]:
        """Each traced config by its key."""
        return {key_of(config): config for config in self.data["configs"]}

    def config(self, key: Key) -> Mapping[str, Any]:
        try:
            return self.configs[key]
        except KeyError:
            raise Untraced(label(key)) from None

    def windows(self, key: Key) -> list[dict[str, Any]]:
        return [w for launch in self.config(key)["launches"] if launch["status"] == "ok" for w in launch["readings"]]

    def peak(self, key: Key) -> int:
        return max(launch["peak_rss_bytes"] for launch in self.config(key)["launches"])

    def fits(self, key: Key) -> bool:
        return self.capacity is None or self.peak(key) <= self.capacity

    def true_value(self, key: Key) -> float:
        return statistics.fmean(w["throughput"] for w in self.windows(key))

    def interval(self, key: Key) -> tuple[float, float]:
        """The 95 % interval of the config's mean throughput: its mean +- INTERVAL_Z standard errors,
        from the spread of its windows (one window: no width)."""
        values = [w["throughput"] for w in self.windows(key)]
        mean = statistics.fmean(values)
        error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
        return mean - INTERVAL_Z * error, mean + INTERVAL_Z * error

    def optimum(self) -> tuple[float, Key]:
        """The best mean over the configs both searches choose from: without a capacity every traced
        config; under one, those that fit in the space DeepSpeed's rule sets there (`in_space`)."""
        return max((self.true_value(key), key) for key in self.candidates())

    def candidates(self) -> list[Key]:
        """The configs the optimum is taken over: traced, fitting the capacity, in its stage's space."""
        return [key for key in self.configs if self.windows(key) and self.fits(key) and self.in_space(key)]

    def in_space(self, key: Key) -> bool:
        """Whether `key` is in its stage's space under the capacity: the samples a step are the
        largest size that fits at gas 1 (plain, else checkpointed when nothing plain fits: the
        search's own strategy), and each size runs the gas filling them (gas 1 above them: a
        strategy's larger micro-batch)."""
        if self.capacity is None:
            return True
        stage, mbs, gas, _ = key
        samples = self.top_sizes.get((stage, False)) or self.top_sizes.get((stage, True), 0)
        return gas == max(1, samples // mbs)

    @cached_property
    def top_sizes(self) -> dict[tuple[int, bool], int]:
        """The largest micro-batch that fits at gas 1, per (stage, with checkpointing)."""
        tops: dict[tuple[int, bool], int] = {}
        for stage, mbs, gas, checkpointed in self.configs:
            if gas == 1 and self.fits((stage, mbs, gas, checkpointed)):
                tops[stage, checkpointed] = max(mbs, tops.get((stage, checkpointed), 0))
        return tops

    def user_config(self) -> dict[str, Any]:
        """The config a user tunes this script with (bench/vs_deepspeed.py's)."""
        return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                "optimizer": {"type": "Adam", "params": {"lr": 0.0003, "torch_adam": True}},
                "zero_optimization": {"stage": list(self.data["stages"])},
                "autotuning": {"enabled": True, "fast": True, "metric": "throughput", "start_profile_step": 2,
                               "end_profile_step": 4, "max_train_micro_batch_size_per_gpu": self.data["max_mbs"],
                               "num_tuning_micro_batch_sizes": 3,
                               **({"memory_strategies": list(self.strategies)} if self.strategies else {})}}

    @property
    def strategies(self) -> tuple[str, ...]:
        """The memory strategies the trace holds runs of, which the user's config allows."""
        return tuple(self.data.get("strategies", ()))

    def run(self, seed: int, name: str, ds_config: Mapping[str, Any], profile: bool, engine: bool) -> dict[str, Any]:
        """The record a real launch would leave, one recorded window drawn for it."""
        record: dict[str, Any] = {"name": name, "ds_config": ds_config, "status": "ok"}
        if profile:
            info = self.data["profile"]
            record["metrics"] = dict(info["model_info"])
            record["peak_rss_bytes"] = info["peak_rss_bytes"]
            return record
        key = _key(ds_config)
        windows = self.windows(key)
        if not self.fits(key):
            record.update(status="oom", exit_code=1)
            return record
        window = random.Random(f"{seed}:{name}").choice(windows)
        throughput = window["engine_throughput"] if engine else window["throughput"]
        samples = key[1] * key[2] * self.world
        record["metrics"] = {"throughput": throughput, "latency": samples / throughput * 1e6}
        record["peak_rss_bytes"] = self.peak(key)
        if not engine:
            record["step_seconds"] = list(window["step_seconds"])
        return record


def right(trace: Trace, key: Key) -> bool:
    """Whether naming `key` is right: its mean within 3 % of the trace best's mean (GOOD), or inside
    the best config's 95 % interval (`Trace.interval`): the trace cannot tell the two apart."""
    optimum, best_key = trace.optimum()
    value = trace.true_value(key)
    low, high = trace.interval(best_key)
    return value >= GOOD * optimum or low <= value <= high


@dataclass(frozen=True)
class Outcome:
    """One replay of one search."""

    fraction: float  #: true value of the named config over the optimum (0: none named or untraced)
    launches: int
    named: str
    untraced: bool = False
    right: bool = False  #: the pick is right by `right` (False: none named or untraced)


def _key(config: Mapping[str, Any]) -> Key:
    """An experiment's config's key (the search lists its strategies in autotuning.memory_strategy)."""
    zero = config.get("zero_optimization") or {}
    listed = (config.get("autotuning") or {}).get("memory_strategy") or ()
    return (int(zero.get("stage", 0)), int(config["train_micro_batch_size_per_gpu"]),
            int(config.get("gradient_accumulation_steps", 1)), CHECKPOINTING in listed)


def label(key: Key) -> str:
    return f"z{key[0]} mbs {key[1]} gas {key[2]}" + (" checkpointed" if key[3] else "")


def _outcome(trace: Trace, launches: int, config: Mapping[str, Any] | None) -> Outcome:
    if not config:
        return Outcome(0.0, launches, "none")
    key = _key(config)
    return Outcome(trace.true_value(key) / trace.optimum()[0], launches, label(key), right=right(trace, key))


def ours(trace: Trace, seed: int, capacity: int) -> Outcome:
    stages = tuple(trace.data["stages"])
    settings = SearchSettings(
        ds_config=trace.user_config(), capacity_bytes=capacity, stages=stages, num_gpus=trace.world,
        max_micro_batch_size=int(trace.data["max_mbs"]), start_profile_step=2, end_profile_step=4,
        peak_memory_key="peak_rss_bytes", host_memory=True, concurrency=1,
        memory_strategies=MemoryStrategyKeys(allowed=trace.strategies))
    launches: list[dict[str, Any]] = []

    def run_phase(phase: Phase) -> dict[str, dict[str, Any]]:
        out = {}
        for exp in phase.experiments:
            record = trace.run(seed, exp.name, exp.ds_config, exp.name == PROFILE, engine=False)
            launches.append(record)
            out[exp.name] = record
        return out

    try:
        drive(fast_search(settings), run_phase)
    except Untraced as missing:
        return Outcome(0.0, len(launches), f"untraced {missing}", untraced=True)
    winner = best([r for r in launches if r.get("name") != PROFILE], "throughput", True)
    return _outcome(trace, len(launches), winner["ds_config"] if winner else None)


def deepspeed(trace: Trace, seed: int, capacity: int) -> Outcome:
    def run(name: str, config: dict[str, Any], profile: bool) -> dict[str, Any]:
        return trace.run(seed, name, config, profile, engine=True)

    try:
        result = DeepSpeedFastMode(trace.user_config(), run, capacity=capacity, world=trace.world).tune(
            tuple(trace.data["stages"]))
    except Untraced as missing:
        return Outcome(0.0, 0, f"untraced {missing}", untraced=True)
    return _outcome(trace, len(result.launches), result.best_config)


def every_config_once(trace: Trace, seed: int, capacity: int) -> Outcome:
    """The exhaustive reference: every config the optimum is taken over (`Trace.candidates`), read
    once (a window drawn as for a search's launch), the best reading named. What the trace's own
    noise lets single readings of the whole space tell apart, at many times a search's launches."""
    readings = {key: trace.run(seed, f"once_{label(key)}", _config_of(key), profile=False,
                               engine=False)["metrics"]["throughput"] for key in trace.candidates()}
    named = max(readings, key=readings.get)
    return Outcome(trace.true_value(named) / trace.optimum()[0], len(readings), label(named),
                   right=right(trace, named))


def _config_of(key: Key) -> dict[str, Any]:
    """The ds_config a search's launch of `key` carries (`_key`'s inverse)."""
    stage, mbs, gas, checkpointed = key
    return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage},
            "autotuning": {"memory_strategy": [CHECKPOINTING] if checkpointed else []}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, nargs="?", default=ROOT / "bench" / "traces" / "train_gpt.json")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="first replay seed (default 0)")
    parser.add_argument("--capacity-gib", type=float, default=24.0, help="slot memory (default 24: this machine)")
    args = parser.parse_args()
    if args.replays < 1 or args.capacity_gib <= 0:
        print("error: --replays >= 1 and --capacity-gib > 0", file=sys.stderr)
        return 2
    capacity = int(args.capacity_gib * GiB)
    try:
        trace = Trace(json.loads(args.trace.read_text()), capacity=capacity)
    except (OSError, ValueError) as problem:
        print(f"error: {args.trace}: {problem}; collect one with bench/collect_traces.py", file=sys.stderr)
        return 2
    optimum, where = trace.optimum()
    low, high = trace.interval(where)
    print(f"{trace.data['script']} trace of {trace.data['collected']} ({trace.data['machine']}): "
          f"{len(trace.data['configs'])} configs; optimum {label(where)} in {args.capacity_gib:g} GiB, "
          f"{optimum:.1f} samples/s (mean of its windows, 95 % interval {low:.1f}-{high:.1f}: "
          f"{100 * (1 - low / optimum):.1f} % below)")
    seeds = range(args.seed, args.seed + args.replays)
    for tool, search in (("celery-autotune", ours), ("deepspeed", deepspeed), ("every config once", every_config_once)):
        outcomes = [search(trace, seed, capacity) for seed in seeds]
        fractions = [o.fraction for o in outcomes]
        named = Counter(o.named for o in outcomes).most_common(4)
        print(f"{tool:>16}: right (within {100 * (1 - GOOD):.0f} % of the best's mean or inside its 95 % interval) "
              f"in {100 * sum(o.right for o in outcomes) / len(outcomes):.1f} % of {len(outcomes)} replays; within "
              f"{100 * (1 - GOOD):.0f} % alone {100 * sum(f >= GOOD for f in fractions) / len(fractions):.1f} %; "
              f"fraction median {statistics.median(fractions):.3f}, p10 {quantile(fractions, 0.1):.3f}; "
              f"launches median {statistics.median(o.launches for o in outcomes):.0f}; "
              f"untraced {sum(o.untraced for o in outcomes)}")
        print(f"{'':>16}  named most: " + ", ".join(f"{name} x{count}" for name, count in named))
    return 0


if __name__ == "__main__":
    sys.exit(main())
