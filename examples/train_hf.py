"""Trains a small GPT-2 with the Hugging Face Trainer and DeepSpeed; the script examples/cfg_hf.json tunes.

Why it exists: most DeepSpeed autotuning users drive a ``transformers.Trainer`` script with
``--deepspeed cfg.json`` and give the batch sizes as the Trainer's own flags, so the autotuner must
set ``--per_device_train_batch_size`` and ``--gradient_accumulation_steps`` per experiment through
``autotuning.arg_mappings`` (the Trainer refuses a DeepSpeed config whose micro-batch size differs
from its flag). Nothing is downloaded: the model is built from a ``GPT2Config`` in code and the data
are random tokens generated here. It is an ordinary Trainer script that knows nothing about
autotuning: with an enabled ``autotuning`` section DeepSpeed's engine writes the metrics and exits.
``--gradient_checkpointing`` turns on the Trainer's activation checkpointing; examples/cfg_hf.json
maps it (``arg_mappings.activation_checkpointing``) so the search may use it.

Run one rank by hand::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=.venv/torch_extensions LOCAL_SIZE=1 \\
    RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29612 \\
    .venv/bin/python examples/train_hf.py --deepspeed ds.json --per_device_train_batch_size 4 \\
        --gradient_accumulation_steps 1
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(Dataset):
    """Random token sequences whose labels are the inputs (causal LM): enough to time training."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (size, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed", required=True, help="DeepSpeed config (JSON file)")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--gradient_checkpointing", action="store_true",
                        help="the Trainer's activation checkpointing (recompute in the backward pass)")
    parser.add_argument("--max_steps", type=int, default=20, help="optimizer steps when not autotuning")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the DeepSpeed launcher")
    parser.add_argument("--output_dir", default=None, help="Trainer output folder (default: a temporary one)")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


def main() -> None:
    args = parse_arguments()
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab_size, n_positions=args.seq_len, n_embd=args.n_embd,
                                       n_layer=args.n_layer, n_head=4, bos_token_id=0, eos_token_id=0))
    samples = args.per_device_train_batch_size * args.gradient_accumulation_steps * 64
    data = RandomTokens(samples, args.seq_len, args.vocab_size, args.seed)
    with tempfile.TemporaryDirectory(prefix="train_hf_") as scratch:
        training = TrainingArguments(
            output_dir=args.output_dir or scratch, deepspeed=args.deepspeed,
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps, max_steps=args.max_steps,
            gradient_checkpointing=args.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None,
            learning_rate=3e-4, logging_steps=max(args.max_steps // 4, 1), save_strategy="no", report_to=[],
            dataloader_num_workers=0, dataloader_pin_memory=False, disable_tqdm=True, seed=args.seed)
        result = Trainer(model=model, args=training, train_dataset=data).train()
    if training.process_index == 0:
        print(f"final loss {result.training_loss:.4f} after {result.global_step} optimizer steps", flush=True)


if __name__ == "__main__":
    main()
