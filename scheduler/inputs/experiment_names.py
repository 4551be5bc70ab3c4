"""DeepSpeed's names for full mode's experiments (`z1_rbs5.0e+07_abs1.0e+09_tmbspg60_gas1`).

DeepSpeed names each experiment of a full-mode space by its searched values, and the name is its
folder: whether a config's values can name experiments is a question about the config, asked where
it is read (`scheduler.inputs.full_mode`), so the naming sits here beside it; the search
(`scheduler.search.full_space`) names the experiments it builds with the same functions.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ZERO = "zero_optimization"
MBS = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"

_OFFLOAD_PREFIX = {"offload_param": "op_", "offload_optimizer": "oo_"}
_LARGE = 9000  #: numbers above this are written '{:.1e}' in names


def canonical_name(config: Mapping[str, Any], tuning_keys: Sequence[str], prefix: str = "",
                   omit_val: bool = False) -> str:
    """DeepSpeed's name for `config`: the tuned keys abbreviated, in the config's own key order.

    train_micro_batch_size_per_gpu and gradient_accumulation_steps always count as tuned; offload
    sections are always spelled out (`oo_`/`op_` and their contents); `omit_val` names a space.
    """
    keys = frozenset(tuning_keys) | {MBS, GAS}
    body = _name_part(config, keys, omit_val)
    return prefix + (body or "exp")


def abbreviation(key: str) -> str:
    """`reduce_bucket_size` -> `rbs`: the first letter of each `_`-separated word."""
    return "".join(word[0] for word in key.split("_") if word)


def value_text(value: Any) -> str:
    """How a value is written in a name: T/F for booleans, '{:.1e}' above 9000, else as Python prints it."""
    if isinstance(value, bool):
        return "T" if value else "F"
    if isinstance(value, (int, float)) and value > _LARGE:
        return f"{value:.1e}"
    return f"{value}"


def naming_view(ds_config: Mapping[str, Any]) -> dict[str, Any]:
    """The config in the key order DeepSpeed names it in: zero, mbs, the user's keys, optimizer last."""
    view = {ZERO: ds_config[ZERO], MBS: ds_config[MBS]}
    view.update((k, v) for k, v in ds_config.items() if k not in view and k != "optimizer")
    if "optimizer" in ds_config:
        view["optimizer"] = ds_config["optimizer"]
    return view


def _name_part(section: Mapping[str, Any], keys: frozenset[str], omit_val: bool) -> str:
    name = ""
    for key, value in section.items():
        if key == "arg_mappings":
            continue
        if key in _OFFLOAD_PREFIX:
            name += _OFFLOAD_PREFIX[key] + ("" if omit_val else _offload_part(value))
            continue
        if isinstance(value, Mapping):
            child = _name_part(value, keys, omit_val)
            if child:
                name += child + "_"
        if key not in keys:
            continue
        name += abbreviation(key) + ("" if omit_val else value_text(value)) + "_"
    return name[:-1]


def _offload_part(offload: Any) -> str:
    if offload is None:
        return "None_"
    return "".join(abbreviation(k) + value_text(v) + "_" for k, v in offload.items())
