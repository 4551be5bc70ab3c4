"""Trains the example GPT with plain torch, tunable by the same autotuner as the DeepSpeed script.

It shows that the autotuner does not need DeepSpeed inside the training
script: the script reads the experiment's DeepSpeed config (``--deepspeed_config``,
a path or base64 JSON) and honours the settings that have a plain-torch
equivalent, and ``workers.in_rank.metrics`` writes the same metric file DeepSpeed would
and exits at the same step.

Mapping of DeepSpeed settings (CPU only, ``gloo`` backend):

* ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps`` /
  ``train_batch_size``: completed as DeepSpeed does; gradients are averaged
  over the accumulated micro-batches, with ``DistributedDataParallel.no_sync``
  between boundaries;
* ``optimizer.params`` (lr, betas, eps, weight_decay): ``torch.optim.AdamW``,
  matching DeepSpeed's default ``adam_w_mode`` for ``"type": "Adam"``;
* ``zero_optimization.stage`` >= 1 with more than one rank:
  ``ZeroRedundancyOptimizer``, which shards the optimizer state (ZeRO-1).
  Plain torch has no gradient or parameter partitioning outside FSDP, so
  stages 2 and 3 behave exactly like stage 1 here;
* ``bf16.enabled``: forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``
  with fp32 master weights;
* ``autotuning.model_info.profile``: writes ``model_info.json`` and exits 0,
  like DeepSpeed.  ``activation_mem_per_gpu`` is measured, as DeepSpeed does on
  CPU, as the growth of this process's resident set size across the first
  forward pass at the configured micro-batch size (the autotuner sets it to 1),
  keeping the autograd graph alive; it is not an analytic estimate.

Rank and world size come from RANK / WORLD_SIZE (MASTER_ADDR / MASTER_PORT for
the env:// rendezvous when WORLD_SIZE > 1).  One rank by hand::

    RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 \\
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 \\
    .venv/bin/python examples/train_gpt_torch.py --deepspeed_config cfg.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from gpt_model import (
    GPT,
    SyntheticTokens,
    add_model_arguments,
    config_from_arguments,
    training_flops_per_sample,
)
from torch.nn.parallel import DistributedDataParallel

# Lets a checkout run the example without installing the package; an installed copy still wins.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workers.in_rank.metrics import (  # noqa: E402
    AutotuningMetrics,
    AutotuningSettings,
    BatchSizes,
    load_ds_config,
    resident_memory_bytes,
    write_model_info,
)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--deepspeed_config", required=True, help="DeepSpeed config: JSON/hjson file path or base64 JSON"
    )
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the DeepSpeed launcher; unused")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps to train when not autotuning")
    parser.add_argument("--seed", type=int, default=1234)
    add_model_arguments(parser)
    return parser.parse_args()


def profile_model_info(model: GPT, data: SyntheticTokens, micro_batch: int, path: str, rank: int) -> None:
    """Writes model_info.json on rank 0 from one forward pass, then exits like DeepSpeed."""
    tokens, targets = data.batch(micro_batch)
    before = resident_memory_bytes()
    loss = model(tokens, targets)
    activation_bytes = resident_memory_bytes() - before
    if rank == 0:
        write_model_info(path, model, activation_bytes)
    del loss
    raise SystemExit(0)


def build_optimizer(model: torch.nn.Module, config: dict[str, Any], world_size: int) -> torch.optim.Optimizer:
    params = (config.get("optimizer") or {}).get("params") or {}
    adamw_options = {
        "lr": params.get("lr", 1e-3),
        "betas": tuple(params.get("betas", (0.9, 0.999))),
        "eps": params.get("eps", 1e-8),
        "weight_decay": params.get("weight_decay", 0.01),
    }
    zero_stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if not isinstance(zero_stage, int):
        raise ValueError(f"zero_optimization.stage must be an integer, got {zero_stage!r}")
    if zero_stage >= 1 and world_size > 1:
        # Imported here: torch.distributed.optim pulls in FSDP and costs over a second of start-up.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw_options)
    return torch.optim.AdamW(model.parameters(), **adamw_options)


def bf16_enabled(config: dict[str, Any]) -> bool:
    if (config.get("fp16") or {}).get("enabled", False):
        raise ValueError("fp16 is not supported by this CPU script; use bf16")
    section = config.get("bf16") or config.get("bfloat16") or {}
    return bool(section.get("enabled", False))


def main() -> None:
    args = parse_arguments()
    config = load_ds_config(args.deepspeed_config)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    batch_sizes = BatchSizes.from_ds_config(config, world_size)
    settings = AutotuningSettings.from_ds_config(config)

    torch.manual_seed(args.seed)
    model = GPT(config_from_arguments(args))
    data = SyntheticTokens(model.config.vocab_size, model.config.seq_len, seed=args.seed + rank)
    if settings.profile_model_info:
        profile_model_info(model, data, batch_sizes.micro_batch_per_gpu, settings.model_info_path, rank)

    distributed = world_size > 1
    if distributed:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    trained_model = DistributedDataParallel(model) if distributed else model
    optimizer = build_optimizer(model, config, world_size)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_enabled(config))
    accumulation = batch_sizes.gradient_accumulation_steps
    flops_per_step = training_flops_per_sample(model) * batch_sizes.micro_batch_per_gpu * accumulation
    metrics = AutotuningMetrics(settings, batch_sizes, rank, flops_per_optimizer_step=flops_per_step)

    for _ in range(args.steps * accumulation):
        tokens, targets = data.batch(batch_sizes.micro_batch_per_gpu)
        boundary = metrics.is_gradient_accumulation_boundary
        accumulating = distributed and not boundary
        skip_gradient_sync = trained_model.no_sync() if accumulating else contextlib.nullcontext()
        with skip_gradient_sync:
            with metrics.timed("fwd"), autocast:
                loss = trained_model(tokens, targets)
            with metrics.timed("bwd"):
                (loss / accumulation).backward()
        with metrics.timed("step"):
            if boundary:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        metrics.end_micro_step()

    if rank == 0:
        print(f"final loss {loss.item():.4f} after {metrics.global_steps} optimizer steps", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
