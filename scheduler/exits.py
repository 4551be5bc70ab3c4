"""How a command ends when it fails: one `error:` line on stderr and an exit code, the same for
`scheduler.autotune` (and `celery-autotune --autotuning`) and `scheduler.run`, each in its own words.

Bad input (a `UsageError`) or an embedded cluster that cannot start exits 2; the control worker failing
on the job exits 1; Ctrl-C (or SIGTERM, which each command turns into `KeyboardInterrupt`) exits 130.
What a Redis failure means differs: mid-tuning the finished experiments are kept (1, run again),
while `run` fails before anything ran (2, a wrong URL or password)."""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import redis

from scheduler.cluster.jobs import JobCrashed
from scheduler.embedded.local_cluster import LocalClusterError
from scheduler.errors import UsageError, one_line

#: Exit codes: bad input, a failure of the run, an interrupt (128 + SIGINT).
USAGE, FAILED, INTERRUPTED = 2, 1, 130


@dataclass(frozen=True)
class Endings:
    """One command's words for its failures; `{exc}` is the exception, `{kind}` its class name."""

    crashed: str  #: the control worker failed on the job (`JobCrashed`)
    redis_failed: str  #: Redis failed (`redis.RedisError`)
    redis_code: int  #: the exit code of a Redis failure
    interrupted: str  #: Ctrl-C or SIGTERM


def guarded(command: Callable[[], int], endings: Endings) -> int:
    """Run `command` and return its exit code, or end a failure with one line and its code."""
    try:
        return command()
    except (UsageError, LocalClusterError) as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return USAGE
    except JobCrashed as exc:
        print("error: " + endings.crashed.format(exc=exc), file=sys.stderr)
        return FAILED
    except redis.RedisError as exc:
        print("error: " + endings.redis_failed.format(kind=type(exc).__name__, exc=exc), file=sys.stderr)
        return endings.redis_code
    except KeyboardInterrupt:
        print(endings.interrupted, file=sys.stderr)
        return INTERRUPTED
