"""How `python -m scheduler.autotune` explains a job without a winner, from the typed records: which
exit it takes (2: the script never reported its metric; 1: the configs failed) and the one line per
failure class it prints."""
from __future__ import annotations

from scheduler.autotune import failure_examples, never_reported, typed


def _records(*records: dict) -> list:
    return typed(records)


def test_a_job_whose_every_failure_is_unreported_metrics_is_bad_input():
    records = _records({"name": "profile", "status": "ok"}, {"name": "e1", "status": "no_metrics"},
                       {"name": "e2", "status": "bad_metrics"})
    assert never_reported(records)


def test_one_config_that_ran_out_of_memory_makes_it_a_tuning_without_winner():
    records = _records({"name": "e1", "status": "no_metrics"}, {"name": "e2", "status": "oom"})
    assert not never_reported(records)
    assert not never_reported(_records({"name": "profile", "status": "ok"}))  # nothing failed
    assert not never_reported(_records({"name": "e1"}))  # no status: lost, not unreported


def test_failure_examples_give_one_line_per_status_with_the_first_ones_cause():
    records = _records(
        {"name": "e1", "status": "oom", "cause": {"exit": "killed (SIGKILL)", "error": "over the cap",
                                                  "stderr_tail": "first\nlast line\n\n"}},
        {"name": "e2", "status": "oom", "cause": {"exit": "other"}},
        {"name": "e3", "status": "ok", "exit_after_metrics": {"error": "teardown abort"}},
        {"name": "e4"}, {"name": "profile_model_info", "status": "ok"})
    assert failure_examples(records) == [
        "oom (2): e.g. e1: killed (SIGKILL); over the cap; last line",
        "ok (1): e.g. e3: teardown abort",
        "lost (1): e.g. e4: no cause recorded"]


def test_a_long_cause_is_cut_at_300_characters():
    [line] = failure_examples(_records({"name": "e1", "status": "crashed", "cause": {"error": "x" * 400}}))
    assert line == "crashed (1): e.g. e1: " + "x" * 300 + "..."
