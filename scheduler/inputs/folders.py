"""The results and experiments folders: created with a marker, emptied only when provably ours.

Why: an `"overwrite": true` that `rmtree`s whatever `results_dir` names deletes the user's working
folder on `"results_dir": "."`. So a folder we create gets a marker file (`.celery-autotune`), and
overwrite empties a folder only when

- it carries the marker (or is empty),
- it is not `/`, the home folder, the working folder, the config's folder, nor one of their parents,
- every entry in it is something this tool writes, as `workers.files.layout` lists it (the one list the
  writers take their file names from, so the guard cannot fall behind them): the outputs,
  experiment folders holding only experiment files, the embedded cluster's logs, experiment
  descriptions, and the temporary files of atomic writes an interrupted run leaves; one foreign
  file and the whole overwrite is refused, naming that file.

The folder itself is kept (only its contents go), so a folder the user made for us stays theirs.
Every problem is a `ConfigError` naming the field: a path that is a file, sits under a file, cannot
be created or written.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from scheduler.errors import ConfigError
from workers.files import layout

#: Re-exported: what `workers.files.layout` says this tool writes (tests and callers use these names).
MARKER = layout.MARKER
RESULT_FILES = layout.RESULT_FILES
_EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]{0,199}")


def prepare(folders: list[tuple[str, Path]], config_path: Path, overwrite: bool) -> None:
    """Check, (with `overwrite`) empty, then create each (field, folder); marks what it creates."""
    for field, folder in folders:
        _check_place(field, folder, config_path)
    if overwrite:
        for field, folder in folders:
            empty_owned(field, folder, config_path)
    made: list[Path] = []
    try:
        for field, folder in folders:
            made.extend(_missing_top(folder))
            create(field, folder, config_path)
    except ConfigError:
        for top in reversed(made):  # a later folder failed: leave no trace of the earlier ones
            shutil.rmtree(top, ignore_errors=True)
        raise


def create(field: str, folder: Path, config_path: Path) -> None:
    """Make `folder` (and its parents) and mark it ours when it is new or empty."""
    _check_place(field, folder, config_path)
    try:
        fresh = not folder.exists() or not any(folder.iterdir())
        folder.mkdir(parents=True, exist_ok=True)
        if fresh:
            marker = json.dumps({"created_by": "celery-autotune", "field": field}) + "\n"
            layout.result_file(folder, MARKER).write_text(marker)
    except OSError as exc:
        raise ConfigError(f"{config_path}: autotuning.{field} {folder}: cannot create or write it "
                          f"({exc.strerror or exc}); choose a folder you can write") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{config_path}: autotuning.{field} {folder}: not writable; choose a folder "
                          "you can write or fix its permissions")


def empty_owned(field: str, folder: Path, config_path: Path) -> None:
    """Remove the contents of `folder` if every entry is ours (module docstring); else refuse."""
    where = f"{config_path}: autotuning.{field} {folder}"
    resolved = folder.resolve()
    for name, protected in _protected(config_path):
        if resolved == protected or resolved in protected.parents:
            raise ConfigError(f'{where}: "overwrite": true would empty {name} ({protected}); '
                              "choose a results folder of its own")
    if not folder.exists():
        return
    entries = list(folder.iterdir())
    if entries and not (folder / MARKER).is_file():
        raise ConfigError(f'{where}: "overwrite": true refused: this folder was not created by '
                          f"celery-autotune (no {MARKER} marker); empty it yourself or choose another folder")
    foreign = _foreign_entry(folder)
    if foreign is not None:
        raise ConfigError(f'{where}: "overwrite": true refused: {foreign} was not written by '
                          "celery-autotune; move it away or choose another folder")
    for entry in entries:
        if entry.name == MARKER:
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot remove {entry} ({exc.strerror or exc}); "
                              "fix its permissions") from None


def _missing_top(folder: Path) -> list[Path]:
    """The outermost folder that creating `folder` makes (none when it exists)."""
    missing = [p for p in [folder.absolute(), *folder.absolute().parents] if not p.exists()]
    return missing[-1:]


def _check_place(field: str, folder: Path, config_path: Path) -> None:
    """A folder that is a file, or lies under a file, cannot be a results folder."""
    where = f"{config_path}: autotuning.{field} {folder}"
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{where}: is a file, not a folder; choose a folder path")
    for parent in folder.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{where}: {parent} is a file, so no folder can be made under it; "
                                  "choose another path")
            break


def _protected(config_path: Path) -> list[tuple[str, Path]]:
    places = [("the root folder", Path("/")), ("the working folder", Path.cwd()),
              ("the config's folder", config_path.absolute().parent)]
    try:
        places.append(("the home folder", Path.home()))
    except RuntimeError:
        pass
    return [(name, place.resolve()) for name, place in places]


def _foreign_entry(folder: Path) -> Path | None:
    """The first entry of a marked folder that this tool does not write, or None."""
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if entry.is_symlink():
            return entry
        if entry.is_file():
            if layout.is_result_file(name) or _is_description(entry):
                continue
            return entry
        if not entry.is_dir():
            return entry
        if (entry / MARKER).is_file():
            inner = _foreign_entry(entry)
        elif name == layout.CLUSTER_DIR:
            inner = _first_unknown(entry, layout.is_cluster_file)
        elif _EXPERIMENT_NAME.fullmatch(name) and any((entry / f).is_file() for f in layout.EXPERIMENT_CORE):
            inner = _first_unknown(entry, layout.is_experiment_file)
        else:
            inner = entry
        if inner is not None:
            return inner
    return None


def _first_unknown(folder: Path, known: Callable[[str], bool]) -> Path | None:
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() or not entry.is_file() or not known(entry.name):
            return entry
    return None


def _is_description(entry: Path) -> bool:
    """`<exps_dir>/<name>.json` as `scheduler.report.outputs.write_experiment_descriptions` writes it."""
    if entry.suffix != ".json" or entry.stat().st_size > 4 * 2**20:
        return False
    try:
        data = json.loads(entry.read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and set(data) == layout.DESCRIPTION_KEYS and data.get("name") == entry.stem
