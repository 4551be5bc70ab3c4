"""A failing command ends with one `error:` line and the exit code a script can act on: bad input 2,
a run that failed 1, an interrupt 130; a Redis failure is the run's failure mid-tuning (what was
measured is kept) and bad input to `scheduler.run` (its URL or password)."""
from __future__ import annotations

import signal

import pytest
import redis

from scheduler import autotune, exits, run
from scheduler.cluster.jobs import JobCrashed
from scheduler.embedded.local_cluster import LocalClusterError
from scheduler.errors import UsageError

CASES = [  # (command's endings, what it raises, exit code, what stderr says)
    (autotune.ENDINGS, UsageError("bad\nfield"), 2, "error: bad\\nfield\n"),
    (run.ENDINGS, LocalClusterError("no redis-server"), 2, "error: no redis-server\n"),
    (autotune.ENDINGS, JobCrashed("boom"), 1, "error: the control worker failed on this job (boom); finished "
     "experiments are kept: run the same command again to resume\n"),
    (run.ENDINGS, JobCrashed("boom"), 1, "error: the control worker failed on this run (boom)\n"),
    (autotune.ENDINGS, redis.ConnectionError("gone"), 1, "error: Redis failed during the run (ConnectionError: "
     "gone); finished experiments are kept: run the same command again to resume\n"),
    (run.ENDINGS, redis.AuthenticationError("wrong {password}"), 2, "error: Redis failed (AuthenticationError: "
     "wrong {password}); check that it runs and the password in AUTOTUNE_REDIS_URL, or unset it for an "
     "embedded cluster\n"),
    (autotune.ENDINGS, KeyboardInterrupt(), 130, "interrupted: finished experiments are kept; run the same "
     "command to resume\n"),
    (run.ENDINGS, KeyboardInterrupt(), 130, "interrupted: every rank was stopped\n"),
]


@pytest.mark.parametrize(("endings", "raised", "code", "said"), CASES,
                         ids=[f"{'run' if case[0] is run.ENDINGS else 'autotune'}-{type(case[1]).__name__}"
                              for case in CASES])
def test_a_failure_ends_with_one_line_and_its_code(endings: exits.Endings, raised: BaseException, code: int,
                                                  said: str, capsys: pytest.CaptureFixture[str]) -> None:
    def command() -> int:
        raise raised

    assert exits.guarded(command, endings) == code
    assert capsys.readouterr().err == said


def test_a_command_that_ends_returns_its_own_code() -> None:
    assert exits.guarded(lambda: 3, run.ENDINGS) == 3


def test_another_error_keeps_its_traceback() -> None:
    def command() -> int:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        exits.guarded(command, autotune.ENDINGS)


def test_autotune_turns_sigterm_into_an_interrupt(capsys: pytest.CaptureFixture[str]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert autotune.guarded(lambda: signal.raise_signal(signal.SIGTERM) or 0) == 130
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err.startswith("interrupted: ")
