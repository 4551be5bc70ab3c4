"""Full mode's search spaces: ZeRO knobs x micro-batch sizes, named the way DeepSpeed names them.

DeepSpeed's full mode (`autotuning.fast: false`) tunes, per ZeRO stage, a small grid of ZeRO knobs
(bucket sizes, overlap_comm, ...) combined with the micro-batch sizes its fast phase kept. We keep
its default spaces, its templates and its experiment names (`z1_rbs5.0e+07_abs1.0e+09_tmbspg60_gas1`)
so results folders and summary.txt read the same, and fix what 0.19.6 gets wrong:

* the user's `zero_optimization` values override the defaults, as DeepSpeed's README promises (a
  scalar fixes the key, a list of two or more values is searched, `null` removes the key); 0.19.6
  ignores the user's zero section and so drops offload settings;
* duplicates are pruned keeping the first occurrence, so grid order is the product order on every
  run (0.19.6 de-duplicates through a `set`, which makes "gridsearch" order hash-seed random);
* the default spaces are read-only data here, never mutated in place.
"""
from __future__ import annotations

import copy
import itertools
import json
import math
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from scheduler.inputs.config import TuningConfig
from scheduler.errors import ConfigError
from scheduler.search.space import Experiment, experiment_config
from workers.files.paths import is_safe_name

ZERO = "zero_optimization"
MBS = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"

_BUCKETS = (5e7, 5e8, 1e9)

#: DeepSpeed's default tuning spaces per ZeRO stage (tuples are searched), in its key order.
DEFAULT_SPACES: Mapping[int, Mapping[str, tuple[Any, ...]]] = MappingProxyType({
    1: MappingProxyType({"reduce_bucket_size": _BUCKETS, "allgather_bucket_size": _BUCKETS}),
    2: MappingProxyType({
        "overlap_comm": (True, False), "reduce_scatter": (False, True), "reduce_bucket_size": _BUCKETS,
        "allgather_bucket_size": _BUCKETS, "contiguous_gradients": (False, True),
    }),
    3: MappingProxyType({
        "overlap_comm": (True, False), "reduce_scatter": (False, True), "reduce_bucket_size": _BUCKETS,
        "allgather_partitions": (True, False), "allgather_bucket_size": _BUCKETS,
        "contiguous_gradients": (False, True),
    }),
})

#: The zero section every experiment of a stage starts from (DeepSpeed's template_zero{1,2,3}.json).
TEMPLATES: Mapping[int, Mapping[str, Any]] = MappingProxyType({
    1: MappingProxyType({"stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}),
    2: MappingProxyType({
        "stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": False,
        "reduce_scatter": True, "reduce_bucket_size": 5e8, "contiguous_gradients": False,
    }),
    3: MappingProxyType({
        "stage": 3, "allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": False,
        "reduce_scatter": True, "reduce_bucket_size": 5e8, "contiguous_gradients": False,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e6,
        "stage3_gather_16bit_weights_on_model_save": False, "sub_group_size": 1e12,
    }),
})

_OFFLOAD_PREFIX = {"offload_param": "op_", "offload_optimizer": "oo_"}
_LARGE = 9000  #: numbers above this are written '{:.1e}' in names


# ---------------------------------------------------------------- names


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
        name += abbreviation(key) + ("" if omit_val else _value_text(value)) + "_"
    return name[:-1]


def _offload_part(offload: Any) -> str:
    if offload is None:
        return "None_"
    return "".join(abbreviation(k) + _value_text(v) + "_" for k, v in offload.items())


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "T" if value else "F"
    if isinstance(value, (int, float)) and value > _LARGE:
        return f"{value:.1e}"
    return f"{value}"


# ---------------------------------------------------------------- the space


def zero_space(user_config: Mapping[str, Any], stage: int) -> dict[str, Any]:
    """The stage's zero search space: DeepSpeed's defaults overridden by the user's zero section.

    Lists (of two or more distinct values) are searched, scalars are fixed, `null` removes the key.
    The user's `stage` is ignored: it says which stages to tune, not this space's stage.
    """
    if stage not in DEFAULT_SPACES:
        raise ValueError(f"full mode tunes ZeRO stages 1-3, not {stage!r}")
    space: dict[str, Any] = {"stage": stage}
    space.update({key: list(values) for key, values in DEFAULT_SPACES[stage].items()})
    for key, value in _user_zero(user_config).items():
        if key == "stage":
            continue
        if value is None:
            space.pop(key, None)
        else:
            space[key] = _searchable(f"{ZERO}.{key}", value)
    return space


def space_name(user_config: Mapping[str, Any], stage: int, micro_batch_sizes: Sequence[int]) -> str:
    """DeepSpeed's tuning-space name, e.g. `z1_rbs_abs_tmbspg` (keys only, in space order)."""
    space = {ZERO: zero_space(user_config, stage), MBS: _distinct(MBS, list(micro_batch_sizes))}
    return canonical_name(space, _tuning_keys(space), prefix=f"z{stage}_", omit_val=True)


def full_experiments(cfg: TuningConfig, stage: int, micro_batch_sizes: Sequence[int],
                     max_train_batch_size_per_gpu: int, num_nodes: int, num_gpus: int,
                     hidden_size: int | None = None) -> list[Experiment]:
    """Every distinct (ZeRO knobs, micro-batch size) point of the stage's space, in grid order.

    The grid order is DeepSpeed's product order: zero keys in space order, the micro-batch size
    varying fastest. gas = max_train_batch_size_per_gpu // mbs (at least 1), as in DeepSpeed.
    `hidden_size` (stage 3) sizes the template's prefetch bucket and persistence threshold.
    """
    if not micro_batch_sizes:
        raise ValueError("full mode needs at least one micro-batch size to combine with")
    user = cfg.ds_config
    space = {ZERO: zero_space(user, stage), MBS: _distinct(MBS, list(micro_batch_sizes))}
    tuning = _tuning_keys(space)
    name_of_space = canonical_name(space, tuning, prefix=f"z{stage}_", omit_val=True)
    template = _template(stage, hidden_size, _user_zero(user))
    experiments: list[Experiment] = []
    for point in _points(space):
        mbs = point[MBS]
        gas = max(1, max_train_batch_size_per_gpu // mbs)
        ds_config = experiment_config(user, stage, mbs, gas, num_nodes * num_gpus,
                                      cfg.start_profile_step, cfg.end_profile_step)
        ds_config[ZERO] = _zero_section(template, point[ZERO])
        name = canonical_name(_naming_view(ds_config), tuning, prefix=f"z{stage}_")
        experiments.append(Experiment(
            name=name, stage=stage, micro_batch_size=mbs, gradient_accumulation_steps=gas,
            ds_config=ds_config, num_nodes=num_nodes, num_gpus=num_gpus, tuning_space=name_of_space))
    _check_unique_names(experiments)
    _check_safe_names(cfg, stage, experiments)
    return experiments


def check_full_mode(cfg: TuningConfig) -> None:
    """Refuse, before anything starts, a full-mode config whose ZeRO values cannot name experiments:
    DeepSpeed puts the searched values in each experiment's name, which is its folder, so a value
    such as "a/b" would otherwise stop the job when its stage's full space is reached. ConfigError
    naming the field; nothing in fast mode (no knob reaches a name there)."""
    if (cfg.ds_config.get("autotuning") or {}).get("fast", True) is not False:
        return
    for stage in (s for s in cfg.stages if s in DEFAULT_SPACES):
        full_experiments(cfg, stage, [1], 1, 1, 1)


def _check_safe_names(cfg: TuningConfig, stage: int, experiments: list[Experiment]) -> None:
    unsafe = next((exp.name for exp in experiments if not is_safe_name(exp.name)), None)
    if unsafe is None:
        return
    space = zero_space(cfg.ds_config, stage)
    for path in _search_paths(space, ()):
        for value in _get(space, path):
            if not is_safe_name(f"x{_value_text(value)}"):
                raise ConfigError(
                    f"{cfg.path}: {ZERO}.{'.'.join(path)} value {json.dumps(value)} cannot be part of an experiment "
                    "name (its folder): full mode names experiments by their values; use values of letters, "
                    "digits and _.+=-")
    raise ConfigError(f"{cfg.path}: full mode would name an experiment {unsafe!r}, which cannot be a folder "
                      f"name; use {ZERO} values of letters, digits and _.+=-")


def _user_zero(user_config: Mapping[str, Any]) -> Mapping[str, Any]:
    zero = user_config.get(ZERO) or {}
    if not isinstance(zero, Mapping):
        raise ConfigError(f'{ZERO} must be an object such as {{"stage": 1}}')
    return zero


def _searchable(field: str, value: Any) -> Any:
    """A user value made ready for the product: lists de-duplicated, one-element lists unwrapped."""
    if isinstance(value, list):
        values = _distinct(field, value)
        return values if len(values) > 1 else values[0]
    if isinstance(value, Mapping):
        return {key: _searchable(f"{field}.{key}", item) for key, item in value.items()}
    return value


def _distinct(field: str, values: list[Any]) -> list[Any]:
    """First occurrences only; 5e8 and 500000000 are the same value, True and 1 are not."""
    if not values:
        raise ConfigError(f"{field} is an empty list; give the values to search, e.g. [5e7, 5e8]")
    seen: dict[str, Any] = {}
    for value in values:
        seen.setdefault(_identity(value), value)
    return list(seen.values())


def _identity(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return f"n:{float(value)!r}"
    return "j:" + json.dumps(value, sort_keys=True)


def _tuning_keys(space: Mapping[str, Any]) -> list[str]:
    """Keys whose value is searched (a list of two or more), at any depth, like DeepSpeed's."""
    keys: list[str] = []
    for key, value in space.items():
        if isinstance(value, Mapping):
            keys.extend(_tuning_keys(value))
        elif isinstance(value, list) and len(value) > 1:
            keys.append(key)
    return keys


def _points(space: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Cartesian product of every list in `space`, the last key varying fastest."""
    paths = list(_search_paths(space, ()))
    choices = [_get(space, path) for path in paths]
    points = []
    for combo in itertools.product(*choices):
        point = copy.deepcopy(dict(space))
        for path, value in zip(paths, combo):
            _set(point, path, value)
        points.append(point)
    return points


def _search_paths(section: Mapping[str, Any], prefix: tuple[str, ...]):
    for key, value in section.items():
        if isinstance(value, Mapping):
            yield from _search_paths(value, prefix + (key,))
        elif isinstance(value, list):
            yield prefix + (key,)


def _get(section: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        section = section[key]
    return section


def _set(section: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        section = section[key]
    section[path[-1]] = value


def _template(stage: int, hidden_size: int | None, user_zero: Mapping[str, Any]) -> dict[str, Any]:
    template = dict(TEMPLATES[stage])
    if stage == 3 and hidden_size:
        template.update(reduce_bucket_size=hidden_size * hidden_size,
                        stage3_prefetch_bucket_size=0.9 * hidden_size * hidden_size,
                        stage3_param_persistence_threshold=10 * hidden_size)
    for key, value in user_zero.items():
        if value is None:
            template.pop(key, None)
    return template


def _zero_section(template: Mapping[str, Any], chosen: Mapping[str, Any]) -> dict[str, Any]:
    """Template keys first (DeepSpeed's order, which names follow), then the user's extra keys."""
    zero = copy.deepcopy(dict(template))
    for key, value in chosen.items():
        if value is None:
            zero.pop(key, None)
        else:
            zero[key] = copy.deepcopy(value)
    return zero


def _naming_view(ds_config: Mapping[str, Any]) -> dict[str, Any]:
    """The config in the key order DeepSpeed names it in: zero, mbs, the user's keys, optimizer last."""
    view = {ZERO: ds_config[ZERO], MBS: ds_config[MBS]}
    view.update((k, v) for k, v in ds_config.items() if k not in view and k != "optimizer")
    if "optimizer" in ds_config:
        view["optimizer"] = ds_config["optimizer"]
    return view


def _check_unique_names(experiments: list[Experiment]) -> None:
    seen: dict[str, Experiment] = {}
    for exp in experiments:
        if exp.name in seen:
            raise ConfigError(
                f"{ZERO} values give two experiments the same name {exp.name}; names keep two "
                "significant digits ('{:.1e}'), so use values that differ within them")
        seen[exp.name] = exp
