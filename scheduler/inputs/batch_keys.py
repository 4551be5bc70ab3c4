"""The config's global-batch keys, typed where the config is read (`BatchKeys`), and what they come to
on one experiment's GPUs (`on_gpus`): the global batch kept (`GlobalBatch`) and the listed micro-batch
sizes that keep it.

Why here: the search keeps the user's `train_batch_size` (`scheduler.search.global_batch` says why
and how), but what the user asked for, and whether it can be kept at all, is a question about the
input: a refusal is one `error:` line naming the file, the key and the fix (`ConfigError`), and the
search receives typed values only. Part of the check needs the experiment's GPUs (the data-parallel
ranks must divide the batch, and `autotuning.mp_size` the GPUs), so `on_gpus` runs where the search's
settings meet the slots.

Also here: the batch a Hugging Face Trainer config (`train_batch_size` "auto") gives as the script's
flags through `arg_mappings` (`cli_batch`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.errors import ConfigError
from scheduler.inputs.search_keys import SearchKeys

#: The autotuning option (DeepSpeed-style name, ours: DeepSpeed has none) that frees or keeps the batch.
KEEP_KEY = "keep_train_batch_size"


@dataclass(frozen=True)
class BatchKeys:
    """The keys of one config that decide the global batch the search keeps."""

    train_batch_size: int | None = None  #: a number in the config; "auto" or absent: None
    keep: bool | None = None  #: autotuning.keep_train_batch_size; None: not given
    listed_sizes: tuple[int, ...] = ()  #: train_micro_batch_size_per_gpu given as a list (sorted, once each)


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


@dataclass(frozen=True)
class ExperimentBatch:
    """The batch keys on one experiment's GPUs: the global batch kept and the listed sizes keeping it."""

    global_batch: GlobalBatch
    micro_batch_sizes: tuple[int, ...] = ()  #: the user's list less the sizes that break the batch; () unlisted


def parse_batch_keys(path: Path, raw: Mapping[str, Any], micro_batch_sizes: tuple[int, ...]) -> BatchKeys:
    """`raw` (the whole config) checked into `BatchKeys`; `micro_batch_sizes`: its checked sizes."""
    keep = (raw.get("autotuning") or {}).get(KEEP_KEY)
    if keep is not None and not isinstance(keep, bool):
        raise ConfigError(f"{path}: autotuning.{KEEP_KEY} must be true or false (a JSON boolean), got {keep!r}")
    number = raw.get("train_batch_size")
    listed = isinstance(raw.get("train_micro_batch_size_per_gpu"), list)
    return BatchKeys(train_batch_size=number if isinstance(number, int) and not isinstance(number, bool) else None,
                     keep=keep, listed_sizes=micro_batch_sizes if listed else ())


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


def on_gpus(path: Path | str, batch: BatchKeys, keys: SearchKeys, gpus: int,
            command_line: tuple[int, int] | None = None) -> ExperimentBatch:
    """The batch keys on an experiment of `gpus` GPUs, checked: a ConfigError naming the file, the
    field and the fix when mp_size does not divide the GPUs or no listed size keeps the batch
    (`global_batch` for the batch itself)."""
    if gpus % keys.mp_size:
        raise ConfigError(f"{path}: autotuning.mp_size ({keys.mp_size}) must divide the GPUs of one "
                          f"experiment ({gpus})")
    dp_size = gpus // keys.mp_size
    kept = global_batch(batch, keys, path, dp_size, command_line)
    sizes = batch.listed_sizes
    if kept.size and sizes:
        share = kept.size // dp_size
        keeping = kept_sizes(share, keys.min_micro_batch_size, keys.max_micro_batch_size)
        sizes = tuple(m for m in sizes if m in keeping)
        if not sizes:
            raise ConfigError(f"{path}: no size in train_micro_batch_size_per_gpu "
                              f"{list(batch.listed_sizes)} keeps the global batch ({kept.source}): none "
                              f"divides its {share} samples per GPU and step; list sizes such as "
                              f"{keeping[-3:]}, or free the batch with "
                              '"autotuning": {"keep_train_batch_size": false}')
    return ExperimentBatch(kept, sizes)


def global_batch(batch: BatchKeys, keys: SearchKeys, path: Path | str, dp_size: int,
                 command_line: tuple[int, int] | None = None) -> GlobalBatch:
    """What the search keeps, checked: a ConfigError naming the file, the field and the fix when the
    batch cannot be kept (not a multiple of the data-parallel ranks, above max_train_batch_size).
    `command_line`: the script's (per-device size, accumulation), `cli_batch`."""
    keep = batch.keep
    if batch.train_batch_size is not None:
        size, source = batch.train_batch_size, f"train_batch_size {batch.train_batch_size} in the config"
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
    if keys.search == "deepspeed":
        return GlobalBatch(source=source, by_deepspeed=True)
    if size % dp_size:
        raise ConfigError(f"{path}: the global batch to keep ({source}) is not a multiple of the {dp_size} "
                          f"data-parallel ranks of one experiment; give a multiple of {dp_size}, choose "
                          f'--num_gpus so the ranks divide it, or set "autotuning": {{"{KEEP_KEY}": false}}')
    limit = keys.max_train_batch_size
    if limit is not None and size > limit:
        raise ConfigError(f"{path}: the global batch to keep ({source}) is above autotuning.max_train_batch_size "
                          f"({limit}); raise the limit, remove it, or set \"{KEEP_KEY}\": false")
    return GlobalBatch(size, source)


def kept_sizes(per_gpu: int, low: int, high: int) -> list[int]:
    """The micro-batch sizes in [low, high] that divide `per_gpu`: the only ones keeping the batch."""
    return [m for m in range(max(1, low), min(high, per_gpu) + 1) if per_gpu % m == 0]
