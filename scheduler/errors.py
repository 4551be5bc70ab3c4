"""One small exception hierarchy, so that every user-facing failure is printed the same way.

A `UsageError` is the user's to fix: its message names the file or field and the fix, and the
command-line tools print it as a single line and exit with status 2. Anything else is a bug or a
fault and keeps its traceback.
"""
from __future__ import annotations

import argparse
from typing import NoReturn


class AutotuneError(Exception):
    """Base of every error this project raises on purpose."""


class UsageError(AutotuneError):
    """Bad input from the user: the message names the file/field and the fix."""


class HostfileError(UsageError):
    """A hostfile that does not follow DeepSpeed's `host slots=N` grammar."""


class ResourceFilterError(UsageError):
    """An --include/--exclude/--num_nodes/--num_gpus selection that cannot be satisfied."""


class ConfigError(UsageError):
    """A tuning config (cfg.json) that cannot be read or does not describe a search."""


class ClusterError(UsageError):
    """The cluster cannot be reached or started: Redis, workers, redis-server binary."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors, so a bad flag prints one `error:` line, exit 2, like any
    other bad input (argparse itself prints the usage block and the error on separate lines)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")


def one_line(message: str) -> str:
    """`message` with control characters escaped (a newline in a path becomes `\\n`), so an error
    that quotes user input is still exactly one line."""
    return "".join(char if char.isprintable() or char == " " else ascii(char)[1:-1] for char in message)
