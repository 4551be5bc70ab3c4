"""DeepSpeed 0.19's own memory estimate, kept beside ours for `"estimator": "deepspeed"` and for the
replays that compare the two (bench/oom_probes.py, bench/deepspeed_replay.py).

Why it is kept: it is what DeepSpeed's autotuner decides with (reference notes, section 1.7: model
states at 20 B/param in fp16 and 16 in fp32, sharded over the world, offload ignored, activations
from the profile run), so a side-by-side run must be able to decide the same way; `memory` is the
model celery-autotune decides with.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from scheduler.search.memory import NO_LIMIT, ModelInfo, StageFit


def deepspeed_fp16(ds_config: Mapping[str, Any]) -> bool:
    """DeepSpeed's precision test: only the fp16 section counts (bf16 is estimated as fp32)."""
    section = ds_config.get("fp16")
    return bool(section.get("enabled", False)) if isinstance(section, Mapping) else False


def deepspeed_instantiation_bytes(num_params: int, stage: int, fp16: bool, world_size: int,
                                  mp_size: int = 1) -> float:
    """DeepSpeed 0.19's model-state estimate (section 1.7): 20 B/param in fp16 and 16 in fp32,
    sharded over the whole world and then divided by mp_size again; offload ignored."""
    if not num_params:
        return 0.0
    params = num_params * (2 if fp16 else 4)
    grads = num_params * (2 if fp16 else 4)
    optimizer = num_params * (16 if fp16 else 8)
    optimizer = optimizer / world_size if stage >= 1 else optimizer
    grads = grads / world_size if stage >= 2 else grads
    params = params / world_size if stage >= 3 else params
    return (params + grads + optimizer) / mp_size


def deepspeed_stage_fits(info: ModelInfo, stage: int, fp16: bool, world_size: int, mp_size: int,
                         capacity_bytes: int) -> StageFit:
    """DeepSpeed's gate: a stage is tried when capacity > instantiation + one sample's activations."""
    required = deepspeed_instantiation_bytes(info.num_params, stage, fp16, world_size, mp_size)
    required += info.activation_mem_per_gpu
    return StageFit(stage, math.floor(required) + 1, capacity_bytes)


def deepspeed_max_micro_batch_size(info: ModelInfo, stage: int, fp16: bool, world_size: int, mp_size: int,
                                   capacity_bytes: int) -> int:
    """DeepSpeed's `int(gpu_mem - instantiation) // activation_mem` (its `calculated_max_mbs`)."""
    inst = deepspeed_instantiation_bytes(info.num_params, stage, fp16, world_size, mp_size)
    if info.activation_mem_per_gpu <= 0:
        return NO_LIMIT
    return max(0, int(capacity_bytes - inst) // info.activation_mem_per_gpu)
