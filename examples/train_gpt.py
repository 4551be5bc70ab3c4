"""Trains the example GPT with DeepSpeed; the script the autotuner tunes in the README.

It is an ordinary DeepSpeed training loop and deliberately knows nothing about
autotuning: when the DeepSpeed config carries an enabled ``autotuning`` section,
the engine itself times the forward, backward and step calls, writes the metric
file on rank 0 after optimizer step ``end_profile_step + 1`` and exits the
process (or, in model-info mode, writes ``model_info.json`` after the first
forward and exits).  Without autotuning it trains ``--steps`` optimizer steps
and prints the final loss on rank 0. ``--activation_checkpointing`` checkpoints every
transformer block (the switch examples/cfg_checkpointing.json maps for the search).

``--deepspeed_config`` may be a path or base64-encoded JSON (the autotuner
passes the latter); DeepSpeed decodes both.  Run one rank by hand with::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=.venv/torch_extensions \\
    RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 LOCAL_SIZE=1 \\
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 \\
    .venv/bin/python examples/train_gpt.py --deepspeed_config cfg.json

LOCAL_SIZE matters on CPU: without it DeepSpeed's CPU accelerator runs
``numactl --hardware`` on every ``device_count()`` call, hundreds of times per
ZeRO-3 run.  In model-info mode the folder of ``model_info_path`` must exist;
DeepSpeed does not create it.
"""

from __future__ import annotations

import argparse

import deepspeed
import torch
from gpt_model import GPT, SyntheticTokens, add_model_arguments, config_from_arguments


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the DeepSpeed launcher; unused")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps to train when not autotuning")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--activation_checkpointing", action="store_true",
                        help="recompute each transformer block in the backward pass (torch.utils.checkpoint)")
    add_model_arguments(parser)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_arguments()
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    model = GPT(config_from_arguments(args), checkpointing=args.activation_checkpointing)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())

    data = SyntheticTokens(model.config.vocab_size, model.config.seq_len, seed=args.seed + engine.global_rank)
    micro_batch_size = engine.train_micro_batch_size_per_gpu()
    total_micro_steps = args.steps * engine.gradient_accumulation_steps()
    for _ in range(total_micro_steps):
        tokens, targets = (t.to(engine.device) for t in data.batch(micro_batch_size))
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()

    if engine.global_rank == 0:
        print(f"final loss {loss.item():.4f} after {engine.global_steps} optimizer steps", flush=True)


if __name__ == "__main__":
    main()
