"""What a slot's warm process preloads, and which scripts it cannot serve: pure decisions over the
script's source, the rank's search path and its environment (`workers.warm.warm_start` acts on them).

Why apart: every rank asks (is the script Python, what does it import at its top level, which of
those are installed packages rather than the user's own modules), and the answers change only when
the script is edited or a package is installed. So the script is read and parsed once per version
of the file (its path, size and mtime) and the imports are looked up once per version of the search
path's folders: reading, parsing and looking up for every rank was 3 ms of CPU on the path from
one experiment's end to the next one's start on 2 cores (bench/dispatch_overhead.py).
"""
from __future__ import annotations

import ast
import functools
import importlib.machinery
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

SWITCH_ENV = "AUTOTUNE_WARM_START"  #: unset or "1" forks ranks from the warm process; "0": every rank cold
#: Read once, when a library is loaded or first asked, so the warm process must already have the rank's.
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "DS_ACCELERATOR", "PYTHONPATH", "PYTHONHASHSEED")
#: What `deepspeed.initialize` imports whatever the script imported itself. torch._dynamo: every
#: torch optimizer's constructor imports it (`torch._disable_dynamo`), so `deepspeed.initialize`
#: paid 2.5-8 s of imports on the 2-core machine after the script's own.
DEEPSPEED_PRELOAD = ("torch", "deepspeed", "torch._dynamo")
#: A script importing one of these calls `deepspeed.initialize` (itself, or through Hugging Face's
#: Trainer or Accelerate given the DeepSpeed config): it gets DEEPSPEED_PRELOAD. A script that
#: imports torch without them (a plain torch script) gets what it imports and what its first rank
#: teaches (`workers.warm.warm_start.WarmStarts.learn`): DeepSpeed and torch._dynamo in its warm process
#: cost 2.3 s of a core at every start here, and their memory for as long as the worker lives.
DEEPSPEED_USERS = ("deepspeed", "transformers", "accelerate")


def switched_off(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """On unless turned off (`AUTOTUNE_WARM_START=0`): the switch is for a script the warm path
    serves wrongly, and for measuring what warm start changes (bench/warm_vs_cold.py)."""
    return environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def why_cold(script_argv: list[str], environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Why the warm path cannot run this script (None: it can)."""
    if switched_off(environ):
        return f"switched off ({SWITCH_ENV}={environ.get(SWITCH_ENV)})"
    script = script_argv[0] if script_argv else ""
    if not script.endswith(".py"):
        return f"not a Python script: {script}"
    try:
        _read_script(script)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"cannot be read as Python ({type(exc).__name__}): the cold run reports it"
    return None


def _read_script(script: str | Path) -> tuple[str, ...]:
    """The script's top-level imports, once per version of the file (its path, size and mtime):
    every rank of a job asks, and reading and parsing it twice was a millisecond or more of each
    rank's start on 2 cores (bench/dispatch_overhead.py). Raises as reading or parsing it would."""
    stat = os.stat(script)
    return _parsed(str(script), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _parsed(script: str, _mtime_ns: int, _size: int) -> tuple[str, ...]:
    source = Path(script).read_bytes()
    ast.parse(source, filename=script)  # as the interpreter reads it (its coding line too)
    return tuple(top_level_imports(source.decode(errors="replace")))


def top_level_imports(source: str) -> list[str]:
    """The absolute modules a script imports at its top level (in order, without duplicates), also
    inside top-level `try`/`if` blocks; `from a.b import c` gives `a.b`. Pure."""
    found: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Try):
                for block in (node.body, *(handler.body for handler in node.handlers), node.orelse, node.finalbody):
                    visit(block)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            for name in names:
                if name != "__future__" and name not in found:
                    found.append(name)

    visit(ast.parse(source).body)
    return found


def installed_roots() -> list[Path]:
    """Where installed packages live: the standard library and site-packages."""
    return [Path(p).resolve() for p in {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib",
                                                                               "platlib")}]


def preload_modules(script: Path, installed: list[Path], search_path: list[str]) -> list[str]:
    """The script's top-level imports that are installed packages (found on the rank's
    `search_path` under `installed`), never a module next to the script or one that shadows a
    package there; with torch, DeepSpeed and torch._dynamo when the script uses DeepSpeed
    (`DEEPSPEED_USERS`: what `deepspeed.initialize` imports anyway)."""
    names = list(_read_script(script))
    if any(name.partition(".")[0] in DEEPSPEED_USERS for name in names):
        names = [*DEEPSPEED_PRELOAD, *names]
    return installed_only(list(dict.fromkeys(names)), installed, search_path)


def beyond_the_standard_library(names: list[str]) -> list[str]:
    """The names a warm process would save a rank the import of: a script that imports only the
    standard library starts in tens of milliseconds cold, and a warm process for it would cost
    the slot a process and its start for nothing."""
    return [name for name in names if name.partition(".")[0] not in sys.stdlib_module_names]


def installed_only(names: list[str], installed: list[Path], search_path: list[str]) -> list[str]:
    """The names whose top-level package the rank would find (on `search_path`) under `installed`.
    Found again only when a folder of the search path changed (a package installed or removed
    there): finding them is a stat per name per folder, for every rank."""
    stamps = tuple(_mtime_ns(entry) for entry in search_path)
    return list(_installed_only(tuple(names), tuple(installed), tuple(search_path), stamps))


def _mtime_ns(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


@functools.lru_cache(maxsize=256)
def _installed_only(names: tuple[str, ...], installed: tuple[Path, ...], search_path: tuple[str, ...],
                    _stamps: tuple[int | None, ...]) -> tuple[str, ...]:
    chosen = []
    for name in names:
        try:
            spec = importlib.machinery.PathFinder.find_spec(name.partition(".")[0], list(search_path))
        except (ImportError, ValueError):
            continue
        places = ([spec.origin] if spec.origin else list(spec.submodule_search_locations or [])) if spec else []
        if places and all(any(Path(place).resolve().is_relative_to(root) for root in installed) for place in places):
            chosen.append(name)
    return tuple(chosen)


def import_time_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The rank's values of what libraries read once: a warm process started with others is not its."""
    return tuple((name, env.get(name, "")) for name in IMPORT_TIME_ENV)



def code_changed(stamp: dict[str, Any] | None) -> str:
    """What changed on disk since the warm process imported its code ("" when nothing), from its
    `workers.warm.warm_preload.code_stamp`: a distribution's METADATA file gone or rewritten (an upgrade,
    a downgrade, a reinstall), or one of its other modules' files (the user's own) modified. One
    stat per distribution and per such file, for every rank; nothing is read."""
    if not stamp:
        return ""
    for name, entry in (stamp.get("distributions") or {}).items():
        version, metadata, mtime = entry
        if _mtime_ns(metadata) != mtime:
            return f"{name} {version} was upgraded, removed or reinstalled"
    for path, (mtime,) in (stamp.get("files") or {}).items():
        if _mtime_ns(path) != mtime:
            return f"{path} was modified"
    return ""
