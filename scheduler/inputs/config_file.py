"""Reading a config file into plain JSON data, before any key is looked at: the file's kind and size,
its syntax (JSON, or hjson as DeepSpeed accepts), duplicate keys, nesting depth, finite numbers.

Apart from the config's meaning (`scheduler.inputs.config`, `.config_schema`) because these checks
are about the file, and each failure names the file (and line) so the command exits 2 without a
traceback.
"""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import hjson

from scheduler.errors import ConfigError

MAX_DEPTH = 64  #: nesting of objects/lists; DeepSpeed configs are 4 deep
MAX_CONFIG_BYTES = 16 * 2**20


def read_config(path: Path) -> dict[str, Any]:
    """The config file at `path` as plain JSON data (hjson accepted), or a ConfigError saying what is wrong."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None  # read_text below reports it with the usual message
    if mode is not None and not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
        raise ConfigError(f"{path}: not a regular file (a device, pipe or socket); give the path of "
                          "your DeepSpeed config file")
    if mode is not None and stat.S_ISREG(mode) and os.stat(path).st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {os.stat(path).st_size} bytes is too large for a DeepSpeed config "
                          f"(at most {MAX_CONFIG_BYTES // 2**20} MiB); check that this is the right file")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; give the path of your DeepSpeed config "
                          'with an "autotuning" section') from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.__class__.__name__}: "
                          f"{getattr(exc, 'strerror', None) or exc}); check the path and its permissions") from None
    too_deep = ConfigError(f"{path}: objects and lists are nested more than {MAX_DEPTH} levels deep; "
                           "a DeepSpeed config needs a few levels, check the file")
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys(path))
    except RecursionError:
        raise too_deep from None
    except json.JSONDecodeError as json_error:
        try:
            data = hjson.loads(text, object_pairs_hook=_no_duplicate_keys(path))
        except RecursionError:
            raise too_deep from None
        except hjson.HjsonDecodeError as hjson_error:
            error = hjson_error if path.suffix == ".hjson" else json_error
            raise ConfigError(f"{path}:{error.lineno}:{error.colno}: invalid JSON/hjson: "
                              f"{error.msg}; fix the syntax there") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a JSON object {{...}}, not {type(data).__name__}")
    _check_tree(path, data)
    return json.loads(json.dumps(data))


def _check_tree(path: Path, data: Any) -> None:
    """Every value of the config: nesting depth at most MAX_DEPTH, numbers finite (JSON has no NaN)."""
    stack: list[tuple[str, Any, int]] = [("", data, 1)]
    while stack:
        where, value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise ConfigError(f"{path}: {where or 'the config'} is nested more than {MAX_DEPTH} "
                                  "levels deep; a DeepSpeed config needs a few levels, check the file")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                child = f"{where}.{key}" if isinstance(value, dict) else f"{where}[{key}]"
                stack.append((child.lstrip("."), item, depth + 1))
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{path}: {where} is {value}, which JSON does not allow; give a finite number")


def _no_duplicate_keys(path: Path):
    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f'{path}: duplicate key "{key}"; keep one of them')
            seen[key] = value
        return seen
    return build
