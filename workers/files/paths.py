"""Results paths that cannot escape their directory.

Experiment names come from configs and from the network; a name such as `../../etc` must never
turn into a path outside the results directory.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]{0,199}$")


def is_safe_name(name: str) -> bool:
    """Whether `name` may name an experiment folder (`safe_child` refuses the rest)."""
    return bool(_SAFE_NAME.fullmatch(name)) and ".." not in name


def safe_child(root: str | os.PathLike, name: str) -> Path:
    """`root/name`, refusing names with separators, '..', or anything resolving outside root.

    With separators and '..' refused, a symlink at `root/name` is the only way out of `root`, so
    only a symlink is resolved (one lstat per call, not a full path resolution: a job step calls
    this for every experiment it looks at)."""
    if not is_safe_name(name):
        raise ValueError(f"unsafe experiment name {name!r}: use letters, digits and _.+=-")
    base = Path(os.path.realpath(root))
    child = base / name
    if child.is_symlink():
        child = child.resolve()
        if child.parent != base:
            raise ValueError(f"experiment name {name!r} escapes {base}")
    return child


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: Path, data: Any, indent: int | None = 2) -> None:
    write_atomic(path, json.dumps(data, indent=indent) + "\n")


def read_json(path: Path) -> Any | None:
    """The JSON in `path`, or None if it is missing or not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
