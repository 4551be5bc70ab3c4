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

Pure: what is kept, the sizes that keep it, and the words the command and the summary print.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.errors import ConfigError

#: The autotuning option (DeepSpeed-style name, ours: DeepSpeed has none) that frees or keeps the batch.
KEEP_KEY = "keep_train_batch_size"
#: How the note of a kept batch begins (the summary's space line reads it).
KEPT_NOTE = "Global batch kept"
#: What would let a config that keeps the batch fit, in the order a user would try them.
FIT_HELP = ("use more GPUs per experiment (--num_gpus / --num_nodes: a smaller share per GPU), a higher "
            "zero_optimization.stage, offload (zero_optimization.offload_optimizer / offload_param, or let the "
            'search choose: "autotuning": {"memory_strategies": ["offload_optimizer", "activation_checkpointing"]}, '
            "the latter with its flag in arg_mappings), or "
            f'free the global batch with "autotuning": {{"{KEEP_KEY}": false}}')


@dataclass(frozen=True)
class GlobalBatch:
    """The global batch the search keeps (`size`, None: not kept), where it came from, and why."""

    size: int | None = None
    source: str = ""  #: "train_batch_size 96", or the command line's flags
    freed: bool = False  #: the user gave a number but keep_train_batch_size false
    by_deepspeed: bool = False  #: a number that "search": "deepspeed" overwrites as DeepSpeed does

    def per_gpu(self, dp_size: int) -> int | None:
        """Samples per data-parallel rank and optimizer step (mbs * gas of every experiment)."""
        return self.size // dp_size if self.size else None


def cli_batch(base_args: Sequence[str], mappings: Mapping[str, str]) -> tuple[int, int] | None:
    """(per-device size, accumulation) the user's command line gives through `arg_mappings`, or None
    unless both flags are mapped and given as numbers: an experiment's accumulation must reach the
    script (the Trainer refuses a DeepSpeed config whose accumulation differs from its own flag)."""
    def value(key: str) -> int | None:
        flag = mappings.get(key)
        if not flag:
            return None
        for index, arg in enumerate(base_args):
            text = base_args[index + 1] if arg == flag and index + 1 < len(base_args) else \
                arg[len(flag) + 1:] if arg.startswith(flag + "=") else None
            if text is not None:
                return int(text) if text.isdigit() and int(text) > 0 else None
        return None
    mbs = value("train_micro_batch_size_per_gpu")
    if mbs is None:
        return None
    gas = value("gradient_accumulation_steps")
    return (mbs, gas) if gas is not None else None


def global_batch(ds_config: Mapping[str, Any], path: Path | str, dp_size: int, search: str,
                 command_line: tuple[int, int] | None = None) -> GlobalBatch:
    """What the search keeps, checked: a ConfigError naming the file, the field and the fix when the
    batch cannot be kept (not a multiple of the data-parallel ranks, above max_train_batch_size)."""
    section = ds_config.get("autotuning") or {}
    keep = section.get(KEEP_KEY)
    if keep is not None and not isinstance(keep, bool):
        raise ConfigError(f"{path}: autotuning.{KEEP_KEY} must be true or false (a JSON boolean), got {keep!r}")
    number = ds_config.get("train_batch_size")
    number = number if isinstance(number, int) and not isinstance(number, bool) else None
    if number is not None:
        size, source = number, f"train_batch_size {number} in the config"
    elif keep and command_line is not None:
        mbs, gas = command_line
        size = mbs * gas * dp_size
        source = (f"the command line's per-device batch {mbs} x accumulation {gas} x {dp_size} data-parallel "
                  f"rank{'s' if dp_size > 1 else ''} = {size}")
    elif keep:
        raise ConfigError(f"{path}: autotuning.{KEEP_KEY} is true but there is no global batch to keep: give "
                          "train_batch_size as a number, or map train_micro_batch_size_per_gpu to the script's "
                          "flag in autotuning.arg_mappings with a number after it in the script arguments")
    else:
        return GlobalBatch()
    if keep is False:
        return GlobalBatch(source=source, freed=True)
    if search == "deepspeed":
        return GlobalBatch(source=source, by_deepspeed=True)
    if size % dp_size:
        raise ConfigError(f"{path}: the global batch to keep ({source}) is not a multiple of the {dp_size} "
                          f"data-parallel ranks of one experiment; give a multiple of {dp_size}, choose "
                          f'--num_gpus so the ranks divide it, or set "autotuning": {{"{KEEP_KEY}": false}}')
    limit = section.get("max_train_batch_size")
    if isinstance(limit, int) and not isinstance(limit, bool) and size > limit:
        raise ConfigError(f"{path}: the global batch to keep ({source}) is above autotuning.max_train_batch_size "
                          f"({limit}); raise the limit, remove it, or set \"{KEEP_KEY}\": false")
    return GlobalBatch(size, source)


def kept_sizes(per_gpu: int, low: int, high: int) -> list[int]:
    """The micro-batch sizes in [low, high] that divide `per_gpu`: the only ones keeping the batch."""
    return [m for m in range(max(1, low), min(high, per_gpu) + 1) if per_gpu % m == 0]


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
