"""Full mode's search spaces as a config defines them: DeepSpeed's ZeRO knobs overridden by the user's
zero_optimization section, checked once where the config is read (`parse_full_mode`).

DeepSpeed's full mode (`autotuning.fast: false`) tunes, per ZeRO stage, a small grid of ZeRO knobs
(bucket sizes, overlap_comm, ...) combined with the micro-batch sizes its fast phase kept. We keep
its default spaces, its templates and its experiment names (`scheduler.inputs.experiment_names`)
so results folders and summary.txt read the same, and fix what 0.19.6 gets wrong:

* the user's `zero_optimization` values override the defaults, as DeepSpeed's README promises (a
  scalar fixes the key, a list of two or more values is searched, `null` removes the key); 0.19.6
  ignores the user's zero section and so drops offload settings;
* duplicates are pruned keeping the first occurrence, so grid order is the product order on every
  run (0.19.6 de-duplicates through a `set`, which makes "gridsearch" order hash-seed random);
* the default spaces are read-only data here, never mutated in place.

Why here: DeepSpeed names each experiment by its searched values and the name is its folder, so an
empty list, a value such as "a/b" or two values that name alike would stop the job when its stage's
full space is reached. Every full-mode stage's points are named at micro-batch 1 as the config is
read, and a refusal is one `error:` line (`ConfigError`); the search (`scheduler.search.full_space`)
builds the experiments from the parsed `FullModeKeys` and these spaces.
"""
from __future__ import annotations

import copy
import itertools
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from scheduler.errors import ConfigError
from scheduler.inputs.experiment_names import GAS, MBS, ZERO, canonical_name, naming_view, value_text
from workers.files.paths import is_safe_name

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


@dataclass(frozen=True)
class FullModeKeys:
    """The user's zero_optimization section as full mode searches it."""

    #: its keys but `stage`: lists de-duplicated (one value: unwrapped), mappings likewise inside, None removes
    zero: Mapping[str, Any] = field(default_factory=dict)


def parse_full_mode(path: Path, raw: Mapping[str, Any], stages: Sequence[int], fast: bool) -> FullModeKeys:
    """The config's zero section (`raw`: the whole config, its zero section already an object) as
    `FullModeKeys`; in full mode refused, as a ConfigError, when a list is empty or a full-mode stage's
    points cannot be named as folders, one by one (nothing in fast mode: no knob reaches a name)."""
    section = raw.get(ZERO) or {}
    keys = FullModeKeys(zero_overrides(section))
    full_stages = [stage for stage in stages if stage in DEFAULT_SPACES]
    if fast or not full_stages:
        return keys
    empty = _first_empty(section, ZERO)
    if empty is not None:
        raise ConfigError(f"{empty} is an empty list; give the values to search, e.g. [5e7, 5e8]")
    for stage in full_stages:
        space = zero_space(keys.zero, stage)
        refusal = name_refusal(path, space, _point_names(raw, keys.zero, stage))
        if refusal is not None:
            raise ConfigError(refusal)
    return keys


def zero_overrides(section: Mapping[str, Any]) -> dict[str, Any]:
    """A zero section's keys but `stage`, made ready for the product: lists de-duplicated keeping the
    first occurrence, one-element lists unwrapped, inside mappings too."""
    return {key: _searchable(value) for key, value in section.items() if key != "stage"}


def zero_space(overrides: Mapping[str, Any], stage: int) -> dict[str, Any]:
    """The stage's zero search space: DeepSpeed's defaults overridden by the user's (`zero_overrides`).

    Lists (of two or more distinct values) are searched, scalars are fixed, `null` removes the key.
    The user's `stage` is not among them: it says which stages to tune, not this space's stage.
    """
    if stage not in DEFAULT_SPACES:
        raise ValueError(f"full mode tunes ZeRO stages 1-3, not {stage!r}")
    space: dict[str, Any] = {"stage": stage}
    space.update({key: list(values) for key, values in DEFAULT_SPACES[stage].items()})
    for key, value in overrides.items():
        if value is None:
            space.pop(key, None)
        else:
            space[key] = copy.deepcopy(value)
    return space


def distinct(values: Sequence[Any]) -> list[Any]:
    """First occurrences only; 5e8 and 500000000 are the same value, True and 1 are not."""
    seen: dict[str, Any] = {}
    for value in values:
        seen.setdefault(_identity(value), value)
    return list(seen.values())


def tuning_keys(space: Mapping[str, Any]) -> list[str]:
    """Keys whose value is searched (a list of two or more), at any depth, like DeepSpeed's."""
    keys: list[str] = []
    for key, value in space.items():
        if isinstance(value, Mapping):
            keys.extend(tuning_keys(value))
        elif isinstance(value, list) and len(value) > 1:
            keys.append(key)
    return keys


def points(space: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Cartesian product of every list in `space`, the last key varying fastest."""
    paths = list(_search_paths(space, ()))
    choices = [_get(space, path) for path in paths]
    found = []
    for combo in itertools.product(*choices):
        point = copy.deepcopy(dict(space))
        for path, value in zip(paths, combo):
            _set(point, path, value)
        found.append(point)
    return found


def template(stage: int, hidden_size: int | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The stage's template zero section; `hidden_size` (stage 3) sizes its prefetch bucket and
    persistence threshold; the user's `null` keys removed."""
    section = dict(TEMPLATES[stage])
    if stage == 3 and hidden_size:
        section.update(reduce_bucket_size=hidden_size * hidden_size,
                       stage3_prefetch_bucket_size=0.9 * hidden_size * hidden_size,
                       stage3_param_persistence_threshold=10 * hidden_size)
    for key, value in overrides.items():
        if value is None:
            section.pop(key, None)
    return section


def zero_section(base: Mapping[str, Any], chosen: Mapping[str, Any]) -> dict[str, Any]:
    """Template keys first (DeepSpeed's order, which names follow), then the user's extra keys; a new
    dict holding `chosen`'s values themselves (each of `points` holds its own copies)."""
    zero = dict(base)
    for key, value in chosen.items():
        if value is None:
            zero.pop(key, None)
        else:
            zero[key] = value
    return zero


def name_refusal(path: Path | str, space: Mapping[str, Any], names: Sequence[str]) -> str | None:
    """Why the experiments of the zero `space` cannot have `names` (two alike, or one that cannot be
    a folder: the first searched value to blame, else the name), or None when they can."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return (f"{ZERO} values give two experiments the same name {name}; names keep two "
                    "significant digits ('{:.1e}'), so use values that differ within them")
        seen.add(name)
    unsafe = next((name for name in names if not is_safe_name(name)), None)
    if unsafe is None:
        return None
    for where in _search_paths(space, ()):
        for value in _get(space, where):
            if not is_safe_name(f"x{value_text(value)}"):
                return (f"{path}: {ZERO}.{'.'.join(where)} value {json.dumps(value)} cannot be part of an "
                        "experiment name (its folder): full mode names experiments by their values; use values of "
                        "letters, digits and _.+=-")
    return (f"{path}: full mode would name an experiment {unsafe!r}, which cannot be a folder "
            f"name; use {ZERO} values of letters, digits and _.+=-")


def _point_names(raw: Mapping[str, Any], overrides: Mapping[str, Any], stage: int) -> list[str]:
    """The names the stage's points get at micro-batch 1 and accumulation 1, in grid order."""
    space = {ZERO: zero_space(overrides, stage), MBS: [1]}
    tuned = tuning_keys(space)
    base = template(stage, None, overrides)
    names = []
    for point in points(space):
        config = dict(raw)
        config.update({MBS: 1, GAS: 1, "train_batch_size": 1})
        config[ZERO] = zero_section(base, point[ZERO])
        names.append(canonical_name(naming_view(config), tuned, prefix=f"z{stage}_"))
    return names


def _searchable(value: Any) -> Any:
    if isinstance(value, list):
        values = distinct(value)
        return values if len(values) != 1 else values[0]
    if isinstance(value, Mapping):
        return {key: _searchable(item) for key, item in value.items()}
    return value


def _first_empty(value: Any, where: str) -> str | None:
    """The field of the first empty list in `value` (at any depth of its mappings), or None."""
    if isinstance(value, list) and not value:
        return where
    if isinstance(value, Mapping):
        for key, item in value.items():
            if where == ZERO and key == "stage":
                continue
            found = _first_empty(item, f"{where}.{key}")
            if found is not None:
                return found
    return None


def _identity(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return f"n:{float(value)!r}"
    return "j:" + json.dumps(value, sort_keys=True)


def _search_paths(section: Mapping[str, Any], prefix: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
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
