"""Which environment variables a multi-node launch carries to every node, and how.

Why this exists: a remote node does not inherit the launching shell's environment, so DeepSpeed's
runner copies a chosen part of it onto each node (as `export` statements for pdsh, `-x`/`-genv`
flags for MPI, `--export=` for Slurm). Users rely on that for NCCL tuning and PYTHONPATH, and on
`.deepspeed_env` files for anything else. This module computes that set, as pure logic, and renders
it as shell text that survives any value.

Rules kept from DeepSpeed's runner:
- a variable of the launching environment is exported when its name starts with one of
  EXPORT_PREFIXES (`MLFLOW`, `PYTHON`, `MV2`, `UCX`, and the CUDA accelerator's `NCCL`);
- when `AISC_JOB_NAME` is set, the exact names `NCCL_IB_HCA` and `UCX_NET_DEVICES` are not exported
  (such clusters configure those per node);
- PYTHONPATH is exported with the working directory in front, so the user's modules resolve on
  every node;
- then the env file is applied: its name is `$DS_ENV_FILE` or `.deepspeed_env`, read first from the
  home directory and then from the working directory; both are applied, so the working directory's
  file wins, and a file wins over the environment. Lines are `KEY=VALUE`, split at the first `=`,
  key and value stripped of surrounding blanks. Keys keep the position of their first appearance.

Deliberate differences from DeepSpeed, and why:
- values are kept raw and quoted with `shlex.quote` only when shell text is rendered. DeepSpeed
  wraps a value in double quotes when it holds an unusual character, which lets the remote shell
  expand `$`, backticks and `\\`, breaks on values containing `"`, and leaves literal quote
  characters in MPI and Slurm flags, where no shell removes them.
- values taken from the environment are not stripped: the remote value equals the local one.
- blank lines and lines starting with `#` in an env file are skipped (DeepSpeed fails on them with
  an unpacking error); a line without `=` or with a key that is not a shell variable name is an
  error naming the file and line (DeepSpeed accepts `export K=V` and produces a broken command).
- environment variables whose names are not shell variable names are skipped: no shell can set them.
- an empty PYTHONPATH is replaced by the working directory alone; DeepSpeed writes `cwd:`, whose
  trailing empty entry means "the current directory" to Python.
- a secret (`is_secret`: a name that says password, token, secret, credential or key, or a URL with a
  password as its value, such as MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN, HF_TOKEN or an
  MLFLOW_TRACKING_URI with `user:pass@`) never goes onto a command line, where every user of the host
  reads it in /proc/<pid>/cmdline and `--dry_run` prints it: the backends name it and take its value
  from the launching process's environment (`scheduler.launch.launchers`), and pdsh, which forwards
  no environment, has each node read it from a file only the user can read (`write_private_file`).
"""
from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping

from scheduler.errors import UsageError
from workers.state import redis_url
from workers.state.redis_url import REDIS_URL_VARIABLE

EXPORT_PREFIXES: tuple[str, ...] = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
"""Name prefixes of the variables copied from the launching environment to every node."""

EXCLUDED_WHEN_SET: Mapping[str, tuple[str, ...]] = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}
"""While the key variable is set, these exact names are not exported."""

ENV_FILE_NAME = ".deepspeed_env"
ENV_FILE_VARIABLE = "DS_ENV_FILE"

ReadText = Callable[[str], "str | None"]
"""Reads a file's text; returns None when there is no regular file at that path."""

_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def is_variable_name(name: str) -> bool:
    """True for names a POSIX shell can export (letters, digits, underscore; no leading digit)."""
    return _VARIABLE_NAME.match(name) is not None


def launch_pythonpath(environ: Mapping[str, str], cwd: str) -> str:
    """PYTHONPATH for the nodes: the working directory, then whatever PYTHONPATH already held."""
    existing = environ.get("PYTHONPATH", "")
    return f"{cwd}:{existing}" if existing else cwd


def exports_from_environ(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """The variables of `environ` that DeepSpeed's prefix rule exports, in `environ` order."""
    with_path = dict(environ)
    with_path["PYTHONPATH"] = launch_pythonpath(environ, cwd)
    excluded = _excluded_names(environ)
    return {
        name: value
        for name, value in with_path.items()
        if name.startswith(EXPORT_PREFIXES) and name not in excluded and is_variable_name(name)
    }


def env_file_paths(environ: Mapping[str, str], home_dir: str, cwd: str) -> tuple[str, str]:
    """The two env files, in the order they are applied: home directory, then working directory."""
    name = environ.get(ENV_FILE_VARIABLE) or ENV_FILE_NAME
    return os.path.join(home_dir, name), os.path.join(cwd, name)


def parse_env_file(text: str, source: str = "<env file>") -> dict[str, str]:
    """Parse `KEY=VALUE` lines; blank lines and `#` comments are skipped, later keys win."""
    entries: dict[str, str] = {}
    for line_number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, equals, value = stripped.partition("=")
        key = key.strip()
        if not equals:
            raise UsageError(f"{source}, line {line_number}: {stripped!r} has no '='; write KEY=VALUE")
        if not is_variable_name(key):
            raise UsageError(
                f"{source}, line {line_number}: {key!r} is not a variable name; "
                f"write KEY=VALUE with KEY made of letters, digits and '_' (no 'export')"
            )
        entries[key] = value.strip()
    return entries


def read_env_file(path: str) -> str | None:
    """The text of the env file at `path`, or None when there is no regular file there."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text; save it as plain KEY=VALUE lines") from None
    except OSError as error:
        raise UsageError(f"{path}: cannot be read ({error.strerror}); make it readable or remove it") from None


def collect_exports(
    environ: Mapping[str, str],
    *,
    home_dir: str,
    cwd: str,
    read_text: ReadText = read_env_file,
) -> dict[str, str]:
    """Everything exported to every node, in order: prefixed variables, then both env files."""
    exports = exports_from_environ(environ, cwd)
    for path in env_file_paths(environ, home_dir, cwd):
        text = read_text(path)
        if text is not None:
            exports.update(parse_env_file(text, source=path))
    return exports


def export_statement(name: str, value: str) -> str:
    """`export NAME=VALUE;` with the value quoted so that a shell reads it back unchanged."""
    if not is_variable_name(name):
        raise UsageError(f"cannot export {name!r}: not a shell variable name")
    return f"export {name}={shlex.quote(value)};"


def render_exports(exports: Mapping[str, str]) -> str:
    """All exports as one shell fragment, `export A=1; export B='x y';`, in mapping order."""
    return " ".join(export_statement(name, value) for name, value in exports.items())


#: Variable names that hold a credential, whatever their value.
SECRET_NAME = re.compile(r"PASSWORD|PASSWD|TOKEN|SECRET|CREDENTIAL|API_?KEY|ACCESS_KEY|PRIVATE_KEY|AUTH",
                         re.IGNORECASE)
#: A value holding a URL with a password in its user info (`https://user:pass@host`).
URL_WITH_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:[^/@\s]+@")


def is_secret(name: str, value: str) -> bool:
    """True for a variable whose value must not be shown: a credential's name or a URL with a password."""
    return SECRET_NAME.search(name) is not None or URL_WITH_PASSWORD.search(value) is not None


def split_secrets(exports: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the exports a command line may carry, the secret ones), each in mapping order."""
    plain = {name: value for name, value in exports.items() if not is_secret(name, value)}
    return plain, {name: value for name, value in exports.items() if name not in plain}


def write_private_file(path: str, exports: Mapping[str, str]) -> None:
    """`exports` as `export NAME=VALUE;` lines in a new file at `path` that only this user can read
    (created so, never widened by the umask; an existing file is an error, never overwritten)."""
    text = "".join(export_statement(name, value) + "\n" for name, value in exports.items())
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)


def source_private_file(path: str | None, names: list[str]) -> str:
    """Shell words that export the variables `names` from the file at `path` (`write_private_file`),
    or stop with status 2 and a line saying why when this host cannot read it."""
    if path is None or not path.startswith("/"):
        raise ValueError("secret exports need the absolute path of the file they are read from")
    quoted = shlex.quote(path)
    why = shlex.quote(f"error: {path} is not readable on this node: the secret variables {', '.join(names)} "
                      "reach every node through this file, so the working directory must be on a file "
                      "system every node shares")
    return f"[ -r {quoted} ] || {{ echo {why} >&2; exit 2; }}; . {quoted};"


def _excluded_names(environ: Mapping[str, str]) -> frozenset[str]:
    names: Iterable[str] = (
        name for trigger, listed in EXCLUDED_WHEN_SET.items() if trigger in environ for name in listed
    )
    return frozenset(names)


#: Numeric variables read by the submitting command and the workers: name -> (smallest, largest,
#: integer?). Checked up front so a typo is one line, not a traceback at import or a worker that dies.
NUMERIC_VARIABLES: Mapping[str, tuple[float, float, bool]] = {
    "AUTOTUNE_LEASE_S": (1.0, 24 * 3600.0, False),
    "AUTOTUNE_LOST_GRACE_S": (0.0, 7 * 24 * 3600.0, False),
    "AUTOTUNE_MAX_ATTEMPTS": (1, 100, True),
    "AUTOTUNE_VISIBILITY_TIMEOUT": (60, 365 * 24 * 3600, True),
    "AUTOTUNE_SLOTS_PER_NODE": (0, 1024, True),
    "AUTOTUNE_GPU_WAIT_S": (0.0, 3600.0, False),
    "AUTOTUNE_MEASURED_GRACE_S": (0.0, 3600.0, False),
    "AUTOTUNE_CLUSTER_WAIT_S": (0.0, 3600.0, False),
    "AUTOTUNE_CONSUMER_STUCK_S": (1.0, 3600.0, False),
}


def check_redis_url(url: str, name: str = REDIS_URL_VARIABLE) -> str:
    """`url` if the commands can use it (`workers.state.redis_url`'s rules; a unix socket allowed: a Redis on
    this machine); otherwise a UsageError naming the variable, with the password masked."""
    try:
        return redis_url.check_redis_url(url, name, hint="or unset it for an embedded cluster")
    except redis_url.RedisUrlError as exc:
        raise UsageError(str(exc)) from None


def check_numeric_variables(environ: Mapping[str, str]) -> None:
    """Every set variable of NUMERIC_VARIABLES is a finite number in its range (UsageError otherwise)."""
    for name, (low, high, integer) in NUMERIC_VARIABLES.items():
        text = environ.get(name)
        if text is None or text == "":
            continue
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not low <= value <= high:
            kind = "an integer" if integer else "a number of seconds"
            raise UsageError(f"{name}={text[:40]!r}: must be {kind} from {low:g} to {high:g}; "
                             "fix or unset it")


def env_number(name: str, default: float, environ: Mapping[str, str] | None = None) -> float:
    """The numeric variable `name`, or `default` when it is unset or unusable: for module constants
    read at import time, before `check_numeric_variables` can report the problem as one line."""
    text = (os.environ if environ is None else environ).get(name)
    try:
        value = float(text) if text else default
    except ValueError:
        return default
    return value if math.isfinite(value) else default
