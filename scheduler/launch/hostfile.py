"""Read the cluster description DeepSpeed users already have: an MPI-style hostfile.

Why this exists: people arrive with `deepspeed --hostfile F` habits and files. Accepting the
same file with the same grammar means nothing has to be rewritten, and every mistake is
reported as one `HostfileError` line that names the file, the line and the fix (DeepSpeed
logs the whole file and raises a bare ValueError).

Grammar, as in DeepSpeed's runner: every line is stripped; blank lines and lines starting
with `#` are skipped; any other line must start with `HOSTNAME slots=N` (whitespace between
the two, no spaces around `=`, lowercase `slots`). Anything after the count and a blank
(`max_slots=4`, `# a comment`) is ignored. `slots=0` is accepted here; such a host simply
offers no devices. A host listed twice, a line that does not match, and a file with no host
lines are errors. The result keeps the file order.

Deliberate differences from DeepSpeed:
- text glued to the count (`slots=2extra`, `slots=1O` typed for 10) is rejected, because
  DeepSpeed silently reads the leading digits and would run on fewer devices than meant;
  a `#` anywhere on a line starts a comment (`w slots=2#x` is 2 slots), since a hostname
  cannot contain `#`.
- a slot count above MAX_SLOTS_PER_HOST (1024) is an error: `slots=1000000000` is a typo, and
  DeepSpeed would try to list that many device ids.
- a hostfile that is named but missing is an error; DeepSpeed falls back to the local
  machine because it always looks for its default `/job/hostfile`. Here the caller decides
  whether a hostfile is used at all, and no hostfile means `local_pool(...)`.
"""
from __future__ import annotations

import os
import re

import psutil

from scheduler.errors import HostfileError, UsageError

MAX_SLOTS_PER_HOST = 1024
"""More devices than any one host has: a larger count is a typo (and would be allocated as a list)."""

MAX_HOSTFILE_BYTES = 2**20
SLOT_WORKER_BYTES = 256 * 2**20
"""RAM one embedded slot worker (celery main process and its pool child) needs while idle."""
MAX_LOCAL_SLOTS = 256

LOCAL_HOSTNAME = "localhost"
"""The name DeepSpeed gives the local machine when there is no hostfile (`--include localhost:1`)."""

_HOST_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)(?:\s.*)?$")
_EXAMPLE_LINE = "'worker-0 slots=8'"


def parse_hostfile(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile text into {host: slot count} in file order; `source` names it in errors."""
    slots_by_host: dict[str, int] = {}
    first_line_of: dict[str, int] = {}
    for line_number, raw_line in enumerate(text.splitlines(), start=1):
        content = _without_comment(raw_line)
        if not content:
            continue
        host, slots = _parse_host_line(content, raw_line, source, line_number)
        if host in first_line_of:
            raise HostfileError(
                f"hostfile {source}, line {line_number}: host {host!r} is already listed on "
                f"line {first_line_of[host]}; list each host once with its total slots"
            )
        first_line_of[host] = line_number
        slots_by_host[host] = slots
    if not slots_by_host:
        raise HostfileError(
            f"hostfile {source}: no host lines found (empty, or only blanks and comments); "
            f"add one line per host such as {_EXAMPLE_LINE}"
        )
    return slots_by_host


def read_hostfile(path: str | os.PathLike[str]) -> dict[str, int]:
    """Read and parse the hostfile at `path`; a missing or unreadable file is a HostfileError."""
    shown = os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        raise HostfileError(f"hostfile {shown}: not a regular file; pass the path of a text file "
                            f"with lines such as {_EXAMPLE_LINE}")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(MAX_HOSTFILE_BYTES + 1)
        if len(text) > MAX_HOSTFILE_BYTES:
            raise HostfileError(f"hostfile {shown}: larger than {MAX_HOSTFILE_BYTES // 2**20} MiB; "
                                "pass a hostfile, one line per host")
    except FileNotFoundError:
        raise HostfileError(
            f"hostfile {shown}: file not found; pass the path of an existing hostfile, "
            f"or leave the hostfile out to use only this machine"
        ) from None
    except UnicodeDecodeError:
        raise HostfileError(
            f"hostfile {shown}: not UTF-8 text; save it as plain text lines such as {_EXAMPLE_LINE}"
        ) from None
    except OSError as error:
        raise HostfileError(
            f"hostfile {shown}: cannot be read ({error.strerror}); pass a readable file"
        ) from None
    return parse_hostfile(text, source=shown)


def local_pool(hostname: str, device_count: int) -> dict[str, int]:
    """The pool used when there is no hostfile: one host offering `device_count` devices."""
    if not hostname or any(character.isspace() for character in hostname):
        raise UsageError(f"local host name {hostname!r} is not a host name; pass a name without spaces")
    if device_count > MAX_SLOTS_PER_HOST:
        raise UsageError(
            f"{device_count} devices on {hostname} is more than one host can have "
            f"(at most {MAX_SLOTS_PER_HOST}); give a real device count"
        )
    if device_count < 1:
        raise UsageError(
            f"no hostfile given and this machine ({hostname}) reports {device_count} devices; "
            f"pass a hostfile or a device count of at least 1"
        )
    return {hostname: device_count}


def max_local_slots() -> int:
    """How many embedded slot workers this machine can hold: SLOT_WORKER_BYTES of RAM each."""
    return max(1, min(MAX_LOCAL_SLOTS, psutil.virtual_memory().total // SLOT_WORKER_BYTES))


def _without_comment(line: str) -> str:
    return line.split("#", 1)[0].strip()


def _parse_host_line(content: str, raw_line: str, source: str, line_number: int) -> tuple[str, int]:
    match = _HOST_LINE.match(content)
    if match is None:
        raise HostfileError(
            f"hostfile {source}, line {line_number}: cannot read {raw_line.strip()!r}; "
            f"write one host per line as 'HOSTNAME slots=N', e.g. {_EXAMPLE_LINE}"
        )
    digits = match.group("slots")
    if len(digits.lstrip("0")) > 6 or int(digits) > MAX_SLOTS_PER_HOST:  # int() of a huge string is slow
        raise HostfileError(
            f"hostfile {source}, line {line_number}: slots={digits[:12]}{'...' if len(digits) > 12 else ''} "
            f"is more devices than one host can have (at most {MAX_SLOTS_PER_HOST}); write the host's real count"
        )
    return match.group("host"), int(digits)
