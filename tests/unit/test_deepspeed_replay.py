"""bench/deepspeed_replay.py must be DeepSpeed 0.19's algorithm: it reproduces trace A of the reference
notes (section 1.14) launch by launch, including the reused max probe and the stale fine probes."""
from __future__ import annotations

from typing import Any

from bench.deepspeed_replay import DeepSpeedFastMode

GiB = 1 << 30
N, A, WORLD = 150_000_000, 200_000_000, 4
STAGE_COST = (0.0, 0.002, 0.006, 0.03)


def trace_law(name: str, config: dict[str, Any], profile: bool) -> dict[str, Any]:
    stage = config["zero_optimization"]["stage"]
    mbs, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    memory = (2 * N / (WORLD if stage >= 3 else 1) + 4 * N / (WORLD if stage >= 2 else 1)
              + 12 * N / (WORLD if stage >= 1 else 1) + A * mbs + GiB)
    if profile:
        return {"name": name, "status": "ok", "ds_config": config,
                "metrics": {"num_params": N, "activation_mem_per_gpu": A}}
    if memory > 16 * GiB:
        return {"name": name, "status": "crashed", "ds_config": config}
    latency = (0.05 + 0.01 * mbs + STAGE_COST[stage]) * gas
    return {"name": name, "status": "ok", "ds_config": config, "metrics": {"throughput": mbs * gas * WORLD / latency}}


def test_trace_a() -> None:
    user = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}, "zero_optimization": {"stage": "all"},
            "autotuning": {"enabled": True}}
    replay = DeepSpeedFastMode(user, trace_law, capacity=16 * GiB, world=WORLD)
    result = replay.tune()
    ran = [r["name"] + ("" if r["status"] == "ok" else "!") for r in result.launches[1:]]
    assert ran == [
        "z0_gas1_tmbspg1", "z0_gas1_tmbspg74!", "z0_gas1_tmbspg70!", "z0_gas1_tmbspg66", "z0_gas2_tmbspg33",
        "z0_gas1_tmbspg64",
        "z1_gas1_tmbspg66", "z1_gas1_tmbspg83!", "z1_gas1_tmbspg79!", "z1_gas1_tmbspg75!", "z1_gas1_tmbspg72",
        "z1_gas1_tmbspg70",
        "z2_gas1_tmbspg72", "z2_gas1_tmbspg86!", "z2_gas1_tmbspg81!", "z2_gas1_tmbspg76", "z2_gas1_tmbspg75",
        "z3_gas1_tmbspg76", "z3_gas1_tmbspg87!", "z3_gas1_tmbspg82!", "z3_gas1_tmbspg77",
    ]
    assert {stage: len(rows) for stage, rows in replay.records.items()} == {0: 7, 1: 7, 2: 6, 3: 6}  # summary rows
    assert result.best_name == "z1_gas1_tmbspg72"
