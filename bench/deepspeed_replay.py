"""DeepSpeed 0.19's fast-mode autotuning, replayed step by step against a `run(name, config)` callback.

Why: to compare our search with DeepSpeed's on the same scripts, DeepSpeed's side must be its real
algorithm, not our DeepSpeed-compatible search (which fixes several of its defects). This follows
the reference notes (/work/shared/research/deepspeed-autotuning.md sections 1.7-1.8) line by line:
the profile run (stage 3, mbs 1), the memory estimate (20 B/param in fp16, activation_mem_per_gpu
from the profile, total device memory, no overhead), the stage gate, sequential min and max probes
(ceil(1.05 m), m, int(0.95 m), first success wins), the binary search with its 5 % plateau stop, the
candidate list with gas = mtbpg // mbs, the fine-grained search with its stale-metric defect (a probe
is recorded with the last candidate's metric), the carry-over of the largest best micro-batch, the
"no need to tune" skip, and the final pick by strict `>` (first wins ties). Any failure is "no
metric". Re-scheduling an experiment whose result exists launches nothing: `launches` counts what
ran, the profile run included.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler.search.space import experiment_config

PLATEAU = 0.05
Run = Callable[[str, dict[str, Any], bool], dict[str, Any]]


@dataclass
class DeepSpeedResult:
    """What one replay did: every launch in order and the experiment DeepSpeed names optimal."""

    launches: list[dict[str, Any]] = field(default_factory=list)
    best_name: str | None = None
    best_config: dict[str, Any] | None = None

    @property
    def failed(self) -> int:
        return sum(r.get("status") != "ok" for r in self.launches)


class DeepSpeedFastMode:
    """One tuning run of DeepSpeed 0.19 fast mode (`deepspeed --autotuning tune`)."""

    def __init__(self, user_config: Mapping[str, Any], run: Run, *, capacity: int, world: int,
                 metric: str = "throughput") -> None:
        self.user = dict(user_config)
        self.run_fn, self.capacity, self.world, self.metric = run, capacity, world, metric
        section = self.user.get("autotuning", {})
        self.max_tbs = section.get("max_train_batch_size")
        self.k = section.get("num_tuning_micro_batch_sizes", 3)
        self.cap = min(section.get("max_train_micro_batch_size_per_gpu", 1024),
                       self.max_tbs // world if self.max_tbs else 1 << 62)
        self.min_cfg_mbs = section.get("min_train_micro_batch_size_per_gpu", 1)
        self.user_mbs = self.user.get("train_micro_batch_size_per_gpu", 1)
        self.gas = self.user.get("gradient_accumulation_steps", 1)
        self.fp16 = bool((self.user.get("fp16") or {}).get("enabled", False))
        self.results: dict[str, dict[str, Any]] = {}  #: name -> record (what exists on disk)
        self.records: dict[int, list[tuple[str, float]]] = {}  #: stage -> (name, metric) as DeepSpeed records
        self.out = DeepSpeedResult()
        self.num_params = 0
        self.activation = 0

    # ------------------------------------------------------------ running experiments

    def _run(self, stage: int, mbs: int, gas: int) -> tuple[str, dict[str, Any], bool]:
        """Schedule one experiment; returns (name, record, launched). Existing results are reused."""
        name = f"z{stage}_gas{gas}_tmbspg{mbs}"
        if name in self.results:
            return name, self.results[name], False
        config = experiment_config(self.user, stage, mbs, gas, self.world, 3, 5)
        config["zero_optimization"] = {"stage": stage}  # DeepSpeed replaces the user's zero section
        record = self.run_fn(name, config, False)
        self.results[name] = record
        self.out.launches.append(record)
        return name, record, True

    def _value(self, record: Mapping[str, Any]) -> float | None:
        if record.get("status") != "ok":
            return None
        return (record.get("metrics") or {}).get(self.metric)

    def _record(self, stage: int, name: str, value: float | None) -> None:
        self.records.setdefault(stage, []).append((name, value or 0.0))

    def _probe(self, stage: int, mbs: int, gas: int) -> float | None:
        """run_ds_config: one experiment, its metric recorded in the stage's space (0 on failure)."""
        name, record, _ = self._run(stage, mbs, gas)
        value = self._value(record)
        self._record(stage, name, value)
        return value

    # ------------------------------------------------------------ the memory estimate

    def _instantiation(self, stage: int) -> float:
        n = self.num_params
        params, grads = n * (2 if self.fp16 else 4), n * (2 if self.fp16 else 4)
        optimizer = n * (16 if self.fp16 else 8)
        if stage >= 1:
            optimizer /= self.world
        if stage >= 2:
            grads /= self.world
        if stage >= 3:
            params /= self.world
        return params + grads + optimizer

    def _calc_max(self, stage: int) -> int:
        return int(self.capacity - self._instantiation(stage)) // max(1, self.activation)

    # ------------------------------------------------------------ tune()

    def tune(self, stages: tuple[int, ...] = (0, 1, 2, 3)) -> DeepSpeedResult:
        config = experiment_config(self.user, 3, 1, 1, self.world, 3, 5)
        config["zero_optimization"] = {"stage": 3}
        profile = self.run_fn("profile_model_info", config, True)
        self.out.launches.append(profile)
        if profile.get("status") != "ok":
            return self.out
        self.num_params = int(profile["metrics"]["num_params"])
        self.activation = int(profile["metrics"]["activation_mem_per_gpu"])
        mbs = max_mbs = 0
        metric_val = 0.0
        for stage in (0, 1, 2, 3):
            runnable = self.capacity > self._instantiation(stage) + self.activation
            if not runnable:
                if stage == 3:
                    break
                continue
            if stage not in stages:
                continue
            next_max, next_mbs, next_metric = self._tune_space(stage, max_mbs)
            if stage < 3 and next_mbs > mbs:
                mbs, max_mbs, metric_val = next_mbs, next_max, next_metric
        self._pick()
        return self.out

    def _pick(self) -> None:
        best_name, best_value = None, None
        for stage in sorted(self.records):
            space_best = None
            for name, value in self.records[stage]:
                if space_best is None or value > space_best[1]:
                    space_best = (name, value)
            if space_best and (best_value is None or space_best[1] > best_value):
                best_name, best_value = space_best
        if best_name is not None and best_value:
            self.out.best_name = best_name
            self.out.best_config = self.results[best_name]["ds_config"]

    def _tune_space(self, stage: int, prev_max: int) -> tuple[int, int, float]:
        calc = self._calc_max(stage)
        if calc < prev_max:
            return 0, 0, 0.0
        low, high = self._min_max(stage, prev_max, calc)
        if high < prev_max or low <= 0 or high <= 0:
            return 0, 0, 0.0
        sizes, mtbpg = self._candidates(low, high)
        if not sizes:
            return 0, 0, 0.0
        self._run_candidates(stage, sizes, mtbpg, low)
        best = max(self.records.get(stage, []), key=lambda item: item[1], default=None)
        if best is None:
            return high, 0, 0.0
        best_mbs = int(best[0].rsplit("tmbspg", 1)[1])
        return high, best_mbs, best[1]

    def _min_max(self, stage: int, min_mbs: int, calc: int) -> tuple[int, int]:
        if min_mbs > calc:
            return -1, -1
        gas = self.gas
        if min_mbs < 1:
            first = self.user_mbs if isinstance(self.user_mbs, int) else 1
            if self._probe(stage, first, gas) is not None:
                low = first
            else:
                if first == self.min_cfg_mbs:
                    return -1, -1
                if self._probe(stage, self.min_cfg_mbs, gas) is None:
                    return -1, -1
                low = self.min_cfg_mbs
        else:
            if self._probe(stage, min_mbs, gas) is None:
                return -1, -1
            low = min_mbs
        maxm = min(calc, self.cap)
        for m in (math.ceil(1.05 * maxm), maxm, int(0.95 * maxm)):
            if m > self.cap:
                continue
            if f"z{stage}_gas{gas}_tmbspg{m}" in self.results:
                return low, m
            if self._probe(stage, m, gas) is not None:
                return low, m
        prev_metric = self._closest_metric(stage, low)
        lo, hi = low, maxm
        while lo <= hi:
            mid = (lo + hi) // 2
            if f"z{stage}_gas{gas}_tmbspg{mid}" in self.results:
                lo = mid + 1
                continue
            value = self._probe(stage, mid, gas)
            if value is not None:
                lo = mid + 1
                if prev_metric and (value - prev_metric) / prev_metric < PLATEAU:
                    break
                prev_metric = value
            else:
                hi = mid - 1
        return low, lo - 1

    def _closest_metric(self, stage: int, mbs: int) -> float | None:
        entries = [(abs(int(n.rsplit("tmbspg", 1)[1]) - mbs), v) for n, v in self.records.get(stage, [])]
        return min(entries)[1] if entries else None

    def _candidates(self, low: int, high: int) -> tuple[list[int], int]:
        if low <= 0 or high <= 0:
            return [], 0
        mtbpg = self.max_tbs // self.world if self.max_tbs else high * self.gas
        if low < high // 2:
            low = high // 2
        stride = (high - low) // self.k or 1
        min_gas = mtbpg // high
        return [m for m in range(low, high, stride) if mtbpg // m != min_gas] + [high], mtbpg

    def _run_candidates(self, stage: int, sizes: list[int], mtbpg: int, low: int) -> None:
        finished: list[tuple[str, float | None]] = []
        reused, ran = [], []
        for mbs in sorted(sizes):
            name, record, launched = self._run(stage, mbs, max(1, mtbpg // mbs))
            (ran if launched else reused).append((name, self._value(record)))
        finished = reused + ran  # skipped experiments finish at scheduling time, the rest after they run
        for name, value in finished:
            self._record(stage, name, value)
        stale = finished[-1][1] if finished else None
        top = sorted(sizes)[-1]
        gas = max(1, mtbpg // top)
        prev_best = self._value(self.results[f"z{stage}_gas{gas}_tmbspg{top}"])
        if prev_best is None:
            return
        lo = sorted(sizes)[-2] + 1 if len(sizes) > 1 else low
        stride = (top - lo) // 3 or 1
        for mbs in reversed(range(lo, top, stride)):
            name, record, _ = self._run(stage, mbs, gas)
            if record.get("status") != "ok":
                self._record(stage, name, None)
                break
            value = stale or 0.0  # DeepSpeed re-reads the last candidate's metrics file (trace E)
            self._record(stage, name, value)
            if value > prev_best * (1 + PLATEAU):
                prev_best = value
            else:
                break
