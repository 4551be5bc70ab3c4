"""Whole dispatch passes over the in-memory stores, with no redis-server: jobs whose shapes the
cluster cannot run now (refused at once, or after a grace), pinned jobs, and slots out of tuning
(others' memory on their GPUs).

One decision at a time (`dispatch._fits_or_refused`) is tested in tests/unit/test_dispatch_decisions.py;
here, what a pass does with it: what else still starts, what `--status` shows, which job ends.
Every expectation is worked out by hand.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from memory_cluster import GiB, Cluster, exp, make_slot, make_spec
from scheduler.cluster import dispatch as dispatch_module
from scheduler.cluster.dispatch import HELD_GRACE_S, REFUSE_GRACE_S

NOW = 5000.04


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


def _misfit_since(cluster: Cluster, job: str, since: float, dispatched: bool = True) -> None:
    """The job's misfit clock set to `since` (Redis: HSET of the state hash), counted as launched."""
    state = cluster.job_db.jobs[job].state
    state["misfit_since"] = str(since)
    if dispatched:
        state["dispatched"] = "1"


def test_a_slot_whose_gpu_others_hold_gets_nothing_and_the_status_says_why(cluster: Cluster, tmp_path: Path) -> None:
    """workers.state.slot_health: n0.gpu1's GPU holds 20 GiB of another process. A two-slot experiment
    cannot start on n0.gpu0 + n0.gpu1: it takes gpu0 + gpu2, the next one-slot experiment must
    wait, and --status names the slot and why; once the mark is lifted, gpu1 is used again."""
    cluster.register(*(make_slot("n0", d, "cuda", 80 * GiB, cuda_index=d) for d in range(3)))
    cluster.slots.mark_unhealthy("n0.gpu1", 20 * GiB, "before a launch")
    cluster.active(make_spec(tmp_path), exp("pair", gpus=2), exp("one"))
    cluster.dispatch()
    assert cluster.started() == [("pair", ["n0.gpu0", "n0.gpu2"])]
    assert cluster.lease("n0.gpu1") is None
    assert cluster.state("j")["head"] == "one"
    assert cluster.state("j")["head_waits"].endswith(
        "; out of tuning until their GPU's memory frees: n0.gpu1 (20.0 GiB used by other processes)")
    cluster.slot_db.marks.delete("n0.gpu1")
    cluster.dispatch()
    assert cluster.started()[-1] == ("one", ["n0.gpu1"])


def test_a_job_that_only_slots_out_of_tuning_could_run_waits_then_is_stopped_saying_why(
        cluster: Cluster, tmp_path: Path) -> None:
    """One GPU, held by a notebook: the job waits (no refusal, nothing started) until HELD_GRACE_S
    has passed with none of its experiments running, then stops with one line naming the slot and
    the fix; a GPU freed in time clears the clock."""
    cluster.register(make_slot("n0", 0, "cuda", 80 * GiB, cuda_index=0))
    cluster.slots.mark_unhealthy("n0.gpu0", 20 * GiB, "before a launch")
    spec = make_spec(tmp_path)
    cluster.active(spec, exp("one"))
    cluster.dispatch()
    assert cluster.work.launched == [] and cluster.jobs.store("j").spec_json() and cluster.events("j") == []
    cluster.slot_db.marks.delete("n0.gpu0")
    cluster.dispatch()  # freed in time: it runs, and the clock is cleared
    assert cluster.started() == [("one", ["n0.gpu0"])] and "misfit_since" not in cluster.state("j")
    finish = cluster.work.launched[0][1]
    cluster.jobs.store("j").finish("one", finish.attempt)
    cluster.slots.release(finish.slots, finish.gang_token)
    cluster.enqueue(spec, exp("two"))
    cluster.slots.mark_unhealthy("n0.gpu0", 20 * GiB, "after a run")
    cluster.dispatch()
    _misfit_since(cluster, "j", time.time() - HELD_GRACE_S + 5)
    cluster.dispatch()
    assert cluster.jobs.store("j").spec_json()  # not yet
    _misfit_since(cluster, "j", time.time() - HELD_GRACE_S - 1)
    cluster.dispatch()
    assert cluster.jobs.store("j").spec_json() is None and len(cluster.work.launched) == 1
    [failed] = cluster.events("j")
    assert failed["kind"] == "failed" and failed["usage"] is True
    assert failed["error"] == ("two needs 1 node(s) x 1 slot(s), which for 10 minutes only slots out of tuning "
                               "could give: n0.gpu0 (20.0 GiB used by other processes); free those GPUs, or leave "
                               "them out (CUDA_VISIBLE_DEVICES for the embedded cluster, or stop their slot "
                               "workers), and run the command again: nothing measured is lost")


def test_a_misfit_in_its_grace_period_holds_back_nothing_else(cluster: Cluster, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch's clock is fixed here: the grace period ends exactly REFUSE_GRACE_S after the misfit began."""
    monkeypatch.setattr(dispatch_module, "time", SimpleNamespace(time=lambda: NOW))
    cluster.register(make_slot("n0", 0))
    cluster.active(make_spec(tmp_path), exp("wide", gpus=2), exp("fits"))
    _misfit_since(cluster, "j", NOW - REFUSE_GRACE_S)
    cluster.dispatch()
    assert cluster.events("j") == [] and cluster.started() == [("fits", ["n0.gpu0"])]
    assert cluster.running("j")["fits"].started == NOW
    assert cluster.running("j")["fits"].deadline == NOW + 100 + 20
    shown = cluster.state("j")
    assert (shown["head"], shown["running"], shown["updated"]) == ("wide", "fits", "5000.0")
    _misfit_since(cluster, "j", NOW - REFUSE_GRACE_S - 0.01)
    cluster.dispatch()
    assert [e["kind"] for e in cluster.events("j")] == ["failed"]


def test_a_shape_that_fits_again_clears_the_misfit(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(make_slot("n0", 0))
    cluster.hold("n0.gpu0", "other/x#1")
    cluster.active(make_spec(tmp_path), exp("a"))
    _misfit_since(cluster, "j", 5.0)
    cluster.dispatch()
    assert "misfit_since" not in cluster.state("j") and cluster.work.launched == []


def test_a_job_that_never_launched_is_refused_at_once_and_once(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(make_slot("n0", 0), make_slot("n0", 1))
    cluster.active(make_spec(tmp_path), exp("fits"), exp("wide", gpus=3), exp("wider", gpus=4))
    cluster.active(make_spec(tmp_path, "other"), exp("o"))
    cluster.dispatch()
    error = ("wide needs 1 node(s) x 3 slot(s) but the cluster has 1 node(s) with at most 2 slot(s) each; "
             "use --num_nodes 1 --num_gpus 2 or fewer")
    assert cluster.events("j") == [{"kind": "failed", "error": error, "usage": True}]
    store = cluster.jobs.store("j")
    assert store.shown() == {} and store.spec_json() is None  # nothing published after the end
    assert cluster.started() == [("o", ["n0.gpu0"])]  # "fits" belonged to the refused job


def test_a_job_submitted_again_after_redis_lost_it_waits_for_its_slots_to_register(
        cluster: Cluster, tmp_path: Path) -> None:
    """Redis restarted without its data: the submitter submits the job again before the workers'
    next heartbeat registers their slots; refusing it then ended a job that was running fine."""
    cluster.submit(make_spec(tmp_path), launched_before=True)
    cluster.enqueue(make_spec(tmp_path), exp("a"))
    cluster.dispatch()
    assert cluster.events("j") == [] and cluster.jobs.store("j").spec_json()
    cluster.register(make_slot("n0", 0))
    cluster.dispatch()
    assert cluster.started() == [("a", ["n0.gpu0"])]


# ---------------------------------------------------------------- pinned jobs


def test_a_pinned_job_runs_on_exactly_its_slots_one_at_a_time(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(make_slot("n0", 0), make_slot("n0", 1))
    cluster.active(make_spec(tmp_path, pinned=[["n0.gpu1"]]), exp("a"), exp("b"))
    cluster.dispatch()
    assert cluster.started() == [("a", ["n0.gpu1"])]
    token = cluster.lease("n0.gpu1")
    assert token is not None and token.startswith("j/a#") and cluster.lease("n0.gpu0") is None
    assert cluster.work.launched[0][1].gang_token == token and cluster.running("j")["a"].token == token
    assert cluster.lapses_at("n0.gpu1") == cluster.slot_db.clock() + 30
    assert cluster.state("j")["head"] == "b" and cluster.jobs.store("j").queued_names() == {"b"}


def test_a_pinned_job_waits_while_its_slot_is_busy(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(make_slot("n0", 0), make_slot("n0", 1))
    cluster.hold("n0.gpu1", "other/x#1")
    cluster.active(make_spec(tmp_path, pinned=[["n0.gpu1"]]), exp("a"))
    cluster.active(make_spec(tmp_path, "free"), exp("f"))
    cluster.dispatch()
    assert cluster.started() == [("f", ["n0.gpu0"])]
    assert cluster.jobs.store("j").spec_json() and cluster.state("j")["head"] == "a"


def test_a_pinned_job_on_a_missing_slot_is_refused_once(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(make_slot("n0", 0))
    cluster.active(make_spec(tmp_path, pinned=[["n0.gpu0", "n0.gpu3"]]), exp("a"), exp("b"))
    cluster.active(make_spec(tmp_path, "other"), exp("o"))
    cluster.dispatch()
    assert cluster.events("j") == [{"kind": "failed", "usage": True, "error":
                                    "no live slot worker for n0.gpu3: start `celery -A tasks worker -Q gpu<i> "
                                    "-n gpu<i>@<host>` there, or change the selection"}]
    store = cluster.jobs.store("j")
    assert store.spec_json() is None and store.shown() == {} and store.depth() == 0
    assert [raw for raw in cluster.jobs.active_spec_jsons()] == [make_spec(tmp_path, "other").to_json().encode()]
    assert cluster.started() == [("o", ["n0.gpu0"])]
