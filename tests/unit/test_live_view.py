"""What the submitter sees of a running job (`scheduler.live_view.LiveView`): the line per finished
experiment, the slots still held by others' memory after it, the phase's estimate and the best so far,
read from the records as the job's events carry them (their JSON), without Redis: the panel's poll
finds it down and keeps its last view."""
from __future__ import annotations

import io
from typing import Any

import redis
from rich.console import Console

from scheduler.live_view import LiveView


def record(name: str, status: str, wall_s: float | None, throughput: float | None = None, **extra: Any) -> dict:
    return {"name": name, "exp_id": 1, "status": status, "metrics": {"throughput": throughput} if throughput else None,
            "ds_config": {"train_micro_batch_size_per_gpu": len(name)}, "slots": ["n.gpu0", "n.gpu1"],
            "started_at": 100.0, "ended_at": 100.0 + (wall_s or 0.0), "wall_s": wall_s, "peak_rss_bytes": 0,
            "ranks": [], **extra}


class RedisDown:
    """A client whose every command fails as an unreachable server's does."""

    def __getattr__(self, name: str) -> Any:
        raise redis.ConnectionError("down")


def view() -> tuple[LiveView, io.StringIO]:
    out = io.StringIO()
    live = LiveView(Console(file=out, width=200, force_terminal=False), client=RedisDown(), job="j",  # type: ignore[arg-type]
                    metric="throughput", maximize=True, total_slots=4, concurrency=2)
    return live, out


def test_each_record_is_one_line_with_its_metric_or_its_status() -> None:
    live, out = view()
    live({"kind": "record", "record": record("z0_a", "ok", 12.5, throughput=250.0)})
    live({"kind": "record", "record": record("z3_bb", "oom", 3.0)})
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["z0_a", "ok", "throughput=250.00", "12.5s", "on", "n.gpu0,n.gpu1"]
    assert lines[1].split() == ["z3_bb", "oom", "oom", "3.0s", "on", "n.gpu0,n.gpu1"]


def test_a_rank_whose_gpu_stayed_used_is_named() -> None:
    live, out = view()
    ranks = [{"rank": 0, "slot": "n.gpu0", "status": "ok"},
             {"rank": 1, "slot": "n.gpu1", "status": "ok", "device_foreign_after_bytes": 3 * 2**30}]
    live({"kind": "record", "record": record("z0_a", "ok", 1.0, throughput=1.0, ranks=ranks)})
    assert "still used a wait after the run: n.gpu1 (3.0 GiB)" in out.getvalue()


def test_the_estimate_is_the_mean_wall_of_the_records_with_one() -> None:
    live, _ = view()
    assert live.estimate_s(0.0) is None
    for name, wall in (("a", 10.0), ("bb", 30.0), ("ccc", None)):
        live({"kind": "record", "record": record(name, "ok", wall, throughput=1.0)})
    live._queued = 3  # two gangs: two rounds of the mean
    assert live.estimate_s(0.0) == 40.0


def test_the_best_so_far_is_the_searchs_pick() -> None:
    live, _ = view()
    assert live._best_so_far() == "best so far: none yet"
    for name, value in (("a", 100.0), ("bb", 250.0), ("ccc", 120.0)):
        live({"kind": "record", "record": record(name, "ok", 1.0, throughput=value)})
    live({"kind": "record", "record": record("dddd", "oom", 1.0)})
    assert live._best_so_far() == "best so far: bb throughput=250.00"
    panel = io.StringIO()
    Console(file=panel, width=200).print(live)  # the panel as Live draws it
    assert "best so far: bb throughput=250.00" in panel.getvalue()
