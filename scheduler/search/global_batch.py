"""A user's global batch (`train_batch_size`) kept through the search, or freed where the user says so.

Why: a config that gives `train_batch_size` as a number usually fixes it for convergence (the
learning rate and its schedule were chosen for it). DeepSpeed's autotuner overwrites it and picks
its winner across different global batch sizes (reference notes 1.9), so a faster config may train a
different model. Here:

- a number in `train_batch_size` is kept unless `autotuning.keep_train_batch_size` is false: every
  experiment has mbs * gas * dp == train_batch_size, so only the micro-batch sizes dividing the
  per-GPU share (train_batch_size / dp) are searched, each with gas = share / mbs, per stage as
  memory allows, and the stages are compared at that same global batch;
- a Hugging Face Trainer config (`train_batch_size` "auto" or absent, its sizes given as script flags
  through `arg_mappings`) keeps the global batch of the user's command line (per-device size x
  accumulation x data-parallel ranks) when `keep_train_batch_size` is true;
- `"search": "deepspeed"` runs DeepSpeed's algorithm, which overwrites the batch as DeepSpeed does;
  the summary says so.

Pure: the sizes that keep it, and the words the command and the summary print. What the config asks
to keep, checked against one experiment's GPUs, comes typed from `scheduler.inputs.batch_keys`.
"""
from __future__ import annotations

from collections.abc import Sequence

from scheduler.inputs.batch_keys import KEEP_KEY, GlobalBatch, kept_sizes  # noqa: F401

#: How the note of a kept batch begins (the summary's space line reads it).
KEPT_NOTE = "Global batch kept"
#: What would let a config that keeps the batch fit, in the order a user would try them.
FIT_HELP = ("use more GPUs per experiment (--num_gpus / --num_nodes: a smaller share per GPU), a higher "
            "zero_optimization.stage, offload (zero_optimization.offload_optimizer / offload_param, or let the "
            'search choose: "autotuning": {"memory_strategies": ["offload_optimizer", "activation_checkpointing"]}, '
            "the latter with its flag in arg_mappings), or "
            f'free the global batch with "autotuning": {{"{KEEP_KEY}": false}}')


def largest_kept(per_gpu: int, limit: int) -> int:
    """The largest size dividing `per_gpu` that is at most `limit` (0 when `limit` < 1)."""
    return max((m for m in range(1, min(limit, per_gpu) + 1) if per_gpu % m == 0), default=0)


def batch_notes(batch: GlobalBatch, dp_size: int) -> list[str]:
    """What the command prints first and summary.txt repeats: kept and why, freed, or overwritten."""
    if batch.size:
        share = batch.per_gpu(dp_size)
        return [f"{KEPT_NOTE}: {batch.size} samples per optimizer step ({batch.source}), as the user's "
                f"training was set up for it: every experiment has micro-batch x accumulation x {dp_size} "
                f"data-parallel rank{'s' if dp_size > 1 else ''} = {batch.size}, so only the micro-batch sizes "
                f"dividing {share} are searched and the stages are compared at the same global batch "
                f'(\"{KEEP_KEY}\": false frees it)']
    if batch.freed:
        return [f"Global batch freed (\"{KEEP_KEY}\": false): {batch.source} is not kept; experiments and the "
                "winner may train on other global batch sizes, so check the learning rate for the winner's"]
    if batch.by_deepspeed:
        return [f"Global batch not kept: \"search\": \"deepspeed\" overwrites {batch.source} as DeepSpeed's "
                "autotuner does; experiments and the winner may train on other global batch sizes"]
    return []


def no_fit_message(batch: GlobalBatch, dp_size: int, failures: Sequence[tuple[int, int, int, str]]) -> str:
    """The one-line refusal when no config keeping the batch ran. `failures`: (mbs, gas, stage, status)
    of every failed experiment; the smallest size among them is named."""
    share = batch.per_gpu(dp_size)
    head = (f"no config keeping the global batch of {batch.size} ({batch.source}; {share} samples per GPU "
            f"and step on {dp_size} data-parallel rank{'s' if dp_size > 1 else ''}) ran: ")
    if failures:
        mbs, gas, _, _ = min(failures)
        at = sorted({(stage, status) for m, _, stage, status in failures if m == mbs})
        where = ", ".join(f"ZeRO-{stage} {status}" for stage, status in at)
        head += f"the smallest size tried, micro-batch {mbs} x accumulation {gas}, failed ({where}); "
    else:
        head += "the memory model says no size dividing it fits at any allowed stage; "
    return head + FIT_HELP
