"""Dispatch, finish and sweep (`scheduler.cluster.dispatch`, `.finish`, `.sweep`) against a real redis-server, with no Celery: slots are registered
by writing their keys, `RecordedWork` (conftest) keeps what would be sent, and every expectation is
read back from the raw keys (running hash, gang keys and their TTLs, state hash, events list) and
compared with values worked out by hand.

Here: whole passes over the slot registry, the gang leases and the round trips of Redis. The
decisions that take a job's store are tested over the in-memory store: a shape's refusal and grace,
when busy slots free (tests/unit/test_dispatch_decisions.py); why a launch is lost, its retry or
give-up, its requeue for a busy GPU (tests/unit/test_sweep_decisions.py)."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from scheduler.cluster import dispatch as dispatch_module
from scheduler.cluster.co_runners import co_runners_of
from scheduler.cluster.dispatch import REFUSE_GRACE_S, cluster_lock, dispatch
from scheduler.cluster.finish import record_and_read, record_finished, requeue_for_busy_gpu
from scheduler.cluster.sweep import sweep
from scheduler.cluster.job_store import JobStore, reserve_seqs
from scheduler.cluster.jobs import JobSpec, TuneSpec, cancel, load_spec, run_fixed, submit
from scheduler.cluster.launches import FinishSpec, QueuedLaunch, RunningLaunch
from scheduler.search.space import Experiment
from workers.state import keys
from workers.state.gang import GangReservations
from workers.slot.op_prebuild import PREBUILD_TIMEOUT_S
from workers.slot.rank_spec import RankSpec
from workers.state.registry import announce_slot
from workers.device.slot import Slot
from workers.state.slot_health import mark_unhealthy
from workers.state.store import RedisSlotStore

GiB = 2**30
HEX32 = re.compile(r"[0-9a-f]{32}")


def make_slot(node: str, device: int, kind: str = "cpu", memory: int = GiB, address: str = "10.0.0.1",
              cuda_index: int = -1, host: str = "") -> Slot:
    return Slot(node, device, kind, memory, address, 1, (device,), worker=f"gpu{device}@{node}",
                instance=f"inst-{node}-{device}", cuda_index=cuda_index, host=host,
                gpu_uuid=f"GPU-{node}-{cuda_index}" if kind == "cuda" else "")


def register(client: redis.Redis, *slots: Slot) -> list[Slot]:
    for slot in slots:
        announce_slot(client, slot)  # as a slot's heartbeat writes it (indexed)
    return list(slots)


def exp(name: str, stage: int = 0, mbs: int = 1, nodes: int = 1, gpus: int = 1, memory: int = 0,
        metric_file: str = "metrics.json") -> dict:
    return Experiment(name, stage, mbs, 1, {"train_micro_batch_size_per_gpu": mbs, "zero_optimization": {"stage": stage}},
                      num_nodes=nodes, num_gpus=gpus, min_memory=memory, metric_file=metric_file).to_json()


def make_spec(tmp_path: Path, job: str = "j", **overrides) -> JobSpec:
    fields = {"results_root": str(tmp_path / job), "cwd": str(tmp_path), "timeout_s": 100.0, "experiments": [],
              "lease_s": 30.0, "lost_grace_s": 20.0, "max_attempts": 2, **overrides}
    return JobSpec(job=job, **fields)


def enqueue(client: redis.Redis, spec: JobSpec, *exps: dict) -> list[QueuedLaunch]:
    first = reserve_seqs(client, len(exps))
    launches = [QueuedLaunch(first + i, e, ["train.py", "--flag", e["name"]]) for i, e in enumerate(exps)]
    JobStore(client, spec.job).queue(launches)
    return launches


def active(client: redis.Redis, work, spec: JobSpec, *exps: dict) -> list[QueuedLaunch]:
    submit(client, work, spec)
    return enqueue(client, spec, *exps)


def running(client: redis.Redis, job: str) -> dict[str, RunningLaunch]:
    return {name.decode(): RunningLaunch.from_json(json.loads(raw))
            for name, raw in client.hgetall(keys.job_running(job)).items()}


def state(client: redis.Redis, job: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(keys.job_state(job)).items()}


def events(client: redis.Redis, job: str) -> list[dict]:
    return [json.loads(raw) for raw in client.lrange(keys.job_events(job), 0, -1)]


def started(work) -> list[tuple[str, list[str]]]:
    return [(finish.name, finish.slots) for _, finish, _, _ in work.launched]


# ---------------------------------------------------------------- dispatch: what starts, and its records


def test_a_launch_whose_ops_are_built_first_gets_the_build_time_on_its_limits(client: redis.Redis, work,
                                                                               tmp_path: Path) -> None:
    """A config with Adam (no torch_adam) has FusedAdam built before its script
    (workers.slot.op_prebuild, up to PREBUILD_TIMEOUT_S); that time is not the script's, so neither the
    lost-launch deadline nor Celery's hard limit may run out during it. A config with torch_adam
    builds nothing and keeps the plain limits."""
    register(client, make_slot("n0", 0), make_slot("n0", 1))
    spec = make_spec(tmp_path)
    fused, plain = exp("fused"), exp("plain")
    fused["ds_config"]["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
    plain["ds_config"]["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}
    active(client, work, spec, fused, plain)
    dispatch(client, work)
    limits = {finish.name: limit for _, finish, limit, _ in work.launched}
    assert limits == {"fused": 100 + PREBUILD_TIMEOUT_S + 300, "plain": 100 + 300}
    launched = running(client, "j")
    assert launched["fused"].deadline == launched["fused"].started + 100 + 20 + PREBUILD_TIMEOUT_S
    assert launched["plain"].deadline == launched["plain"].started + 100 + 20


def test_a_launch_on_gpus_gets_its_waits_for_a_free_gpu_on_its_limits(client: redis.Redis, work, tmp_path: Path,
                                                                     monkeypatch) -> None:
    """Each rank on a GPU may wait AUTOTUNE_GPU_WAIT_S for others' memory to go before its script and
    again after it (workers.slot.rank): not the script's time, so not on its deadline either."""
    monkeypatch.setenv("AUTOTUNE_GPU_WAIT_S", "7")
    register(client, make_slot("n0", 0, "cuda", 80 * GiB, cuda_index=0))
    active(client, work, make_spec(tmp_path), exp("gpu"))
    dispatch(client, work)
    assert work.launched[0][2] == 100 + 14 + 300
    assert running(client, "j")["gpu"].deadline == running(client, "j")["gpu"].started + 100 + 20 + 14



def test_without_active_jobs_nothing_happens(client: redis.Redis, work) -> None:
    register(client, make_slot("n0", 0))
    registered = {key: client.dump(key) for key in client.keys("*")}  # the slot, its index entry and epoch
    dispatch(client, work)
    assert work.launched == [] and {key: client.dump(key) for key in client.keys("*")} == registered


def test_a_launch_is_recorded_in_redis_before_it_is_sent(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, make_slot("n0", 0), make_slot("n0", 1))
    spec = make_spec(tmp_path, local_rank_arg=True)
    a, b, c = active(client, work, spec, exp("a", 1, 2), exp("b"), exp("c"))
    before = time.time()
    dispatch(client, work)
    after = time.time()
    assert started(work) == [("a", ["n0.gpu0"]), ("b", ["n0.gpu1"])]
    ranks, finish, limit, shown = work.launched[0]
    root = os.path.realpath(spec.results_root)
    token = client.get(keys.gang("n0.gpu0")).decode()
    assert token.startswith("j/a#") and client.get(keys.gang("n0.gpu1")).decode().startswith("j/b#")
    assert HEX32.fullmatch(finish.attempt) and limit == 100 + 300 and shown == \
        "(experiment='a', job='j', slots=['n0.gpu0'])"
    assert finish == FinishSpec(job="j", name="a", exp_id=1, attempt=finish.attempt, slots=["n0.gpu0"],
                                gang_token=token, results_root=spec.results_root, world_size=1,
                                ds_config=a.exp["ds_config"], timeout_s=100.0, metric_file="metrics.json",
                                shape=f"{a.exp['stage']}/{a.exp['micro_batch_size']}")
    assert work.launched[1][1].exp_id == 2 and work.launched[1][1].attempt != finish.attempt
    [rank] = ranks
    assert rank.queue == "n0.gpu0" and HEX32.fullmatch(rank.task_id)
    assert rank.shown == "(experiment='a', rank=0, slot='n0.gpu0')"
    description = {"name": "a", "exp_id": 1, "ds_config": a.exp["ds_config"], "num_gpus": 1, "num_nodes": 1,
                   "result_dir": f"{root}/a", "slots": ["n0.gpu0"], "user_script": "train.py",
                   "user_args": ["--flag", "a"]}
    assert rank.spec == RankSpec(job="j", name="a", attempt=finish.attempt, results_root=spec.results_root,
                                 script_argv=a.argv, ds_config=a.exp["ds_config"], rank=0, world_size=1,
                                 local_rank=0, local_world_size=1, node_rank=0, timeout_s=100.0,
                                 cwd=str(tmp_path), metric_file="metrics.json", exp=description,
                                 gang_token=token, lease_s=30.0, cuda_devices=[], local_rank_arg=True)
    # Redis, read back raw
    launched = running(client, "j")
    assert sorted(launched) == ["a", "b"]
    rec = launched["a"]
    assert before <= rec.started <= after and rec.deadline == rec.started + 100 + 20
    assert rec == RunningLaunch(seq=a.seq, exp=a.exp, argv=a.argv, attempt=finish.attempt, queues=["n0.gpu0"],
                                token=token, rank_tasks={"n0.gpu0": rank.task_id}, started=rec.started,
                                deadline=rec.deadline, instances={"n0.gpu0": "inst-n0-0"}, missing_since=None,
                                co_runners=["j/b"])  # b started beside it on node n0, after it
    assert launched["b"].co_runners == ["j/a"]  # and a ran there already
    for queue in ("n0.gpu0", "n0.gpu1"):
        assert 20_000 < client.pttl(keys.gang(queue)) <= 30_000  # the job's lease
    assert client.hkeys(keys.job_queue("j")) == [b"c"]
    assert client.zrange(keys.job_queue_shape("j", "1x1:0"), 0, -1) == [b"c"]
    assert client.hgetall(keys.job_attempts("j")) == {b"a": b"1", b"b": b"1"}
    shown_state = state(client, "j")
    assert before - 0.1 <= float(shown_state.pop("updated")) <= after + 0.1
    assert shown_state == {"dispatched": "1", "exp_ids": "2", "results_dir": spec.results_root, "pending": "1",
                           "running": "a,b", "head": "c",
                           "head_waits": "needs 1 node(s) x 1 free slot(s) at once; the slots that fit are reserved"}
    assert not (tmp_path / "j").exists()  # a fixed job writes no experiment descriptions


def test_ranks_of_a_two_node_gang(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, make_slot("n0", 0, "cuda", cuda_index=5), make_slot("n0", 1, "cuda", cuda_index=7),
             make_slot("n1", 0, "cuda", cuda_index=1), make_slot("n1", 1, "cuda", cuda_index=3),
             make_slot("n1", 2, "cuda", cuda_index=4))
    exps_dir = tmp_path / "exps"
    tune = TuneSpec(str(tmp_path / "cfg.json"), {}, str(exps_dir), "train.py", [], {}, GiB, 2, 2, "cuda", 1)
    spec = make_spec(tmp_path, tune=tune)
    [big] = active(client, work, spec, exp("big", 2, 4, nodes=2, gpus=2))
    dispatch(client, work)
    [(ranks, finish, _, _)] = work.launched
    queues = ["n0.gpu0", "n0.gpu1", "n1.gpu0", "n1.gpu1"]
    assert finish.slots == queues and finish.world_size == 4
    assert [(r.queue, r.spec.rank, r.spec.local_rank, r.spec.local_world_size, r.spec.node_rank,
             r.spec.world_size, r.spec.cuda_devices, r.spec.num_nodes) for r in ranks] == [
        ("n0.gpu0", 0, 0, 2, 0, 4, ["5", "7"], 2), ("n0.gpu1", 1, 1, 2, 0, 4, ["5", "7"], 2),
        ("n1.gpu0", 2, 0, 2, 1, 4, ["1", "3"], 2), ("n1.gpu1", 3, 1, 2, 1, 4, ["1", "3"], 2)]
    assert [r.shown for r in ranks][3] == "(experiment='big', rank=3, slot='n1.gpu1')"
    assert len({r.task_id for r in ranks}) == 4 and all(r.spec.exp["slots"] == queues for r in ranks)
    assert running(client, "j")["big"].rank_tasks == {r.queue: r.task_id for r in ranks}
    assert running(client, "j")["big"].instances == {q: f"inst-{q.replace('.gpu', '-')}" for q in queues}
    assert json.loads((exps_dir / "big.json").read_text()) == {
        "name": "big", "ds_config": big.exp["ds_config"], "num_gpus": 2, "num_nodes": 2}
    assert state(client, "j")["head"] == "-" and state(client, "j")["head_waits"] == "-"
    assert state(client, "j")["running"] == "big" and state(client, "j")["pending"] == "0"


def test_fifo_across_jobs_by_submission_order(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, make_slot("n0", 0))
    one, two = make_spec(tmp_path, "j1"), make_spec(tmp_path, "j2")
    submit(client, work, one)
    submit(client, work, two)
    enqueue(client, two, exp("early2"))  # seq 3 (the two jobs took 1 and 2): the later job's launch first
    enqueue(client, one, exp("late1"))
    dispatch(client, work)
    assert started(work) == [("early2", ["n0.gpu0"])]
    assert state(client, "j1")["head"] == "late1" and state(client, "j2")["running"] == "early2"
    assert state(client, "j1")["running"] == "-"


def test_only_the_free_slots_bound_what_starts(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, *(make_slot("n0", d) for d in range(4)))
    client.set(keys.gang("n0.gpu2"), "other/x#1")
    spec = make_spec(tmp_path)
    active(client, work, spec, *(exp(f"e{i}") for i in range(5)))
    dispatch(client, work)
    assert started(work) == [("e0", ["n0.gpu0"]), ("e1", ["n0.gpu1"]), ("e2", ["n0.gpu3"])]
    assert client.get(keys.gang("n0.gpu2")) == b"other/x#1" and client.pttl(keys.gang("n0.gpu2")) == -1
    assert state(client, "j")["pending"] == "2" and state(client, "j")["head"] == "e3"


def test_a_slot_whose_gpu_others_hold_gets_nothing_and_the_status_says_why(client: redis.Redis, work,
                                                                          tmp_path: Path) -> None:
    """workers.state.slot_health: n0.gpu1's GPU holds 20 GiB of another process. A two-slot experiment
    cannot start on n0.gpu0 + n0.gpu1: it takes gpu0 + gpu2, the next one-slot experiment must
    wait, and --status names the slot and why; once the mark is lifted, gpu1 is used again."""
    register(client, *(make_slot("n0", d, "cuda", 80 * GiB, cuda_index=d) for d in range(3)))
    mark_unhealthy(client, "n0.gpu1", 20 * GiB, "before a launch")
    spec = make_spec(tmp_path)
    active(client, work, spec, exp("pair", gpus=2), exp("one"))
    dispatch(client, work)
    assert started(work) == [("pair", ["n0.gpu0", "n0.gpu2"])]
    assert not client.exists(keys.gang("n0.gpu1"))
    assert state(client, "j")["head"] == "one"
    assert state(client, "j")["head_waits"].endswith(
        "; out of tuning until their GPU's memory frees: n0.gpu1 (20.0 GiB used by other processes)")
    client.delete(keys.unhealthy("n0.gpu1"))
    dispatch(client, work)
    assert started(work)[-1] == ("one", ["n0.gpu1"])


def test_a_job_that_only_slots_out_of_tuning_could_run_waits_then_is_stopped_saying_why(
        client: redis.Redis, work, tmp_path: Path) -> None:
    """One GPU, held by a notebook: the job waits (no refusal, nothing started) until HELD_GRACE_S
    has passed with none of its experiments running, then stops with one line naming the slot and
    the fix; a GPU freed in time clears the clock."""
    register(client, make_slot("n0", 0, "cuda", 80 * GiB, cuda_index=0))
    mark_unhealthy(client, "n0.gpu0", 20 * GiB, "before a launch")
    spec = make_spec(tmp_path)
    active(client, work, spec, exp("one"))
    dispatch(client, work)
    assert work.launched == [] and client.exists(keys.job_spec("j")) and events(client, "j") == []
    client.delete(keys.unhealthy("n0.gpu0"))
    dispatch(client, work)  # freed in time: it runs, and the clock is cleared
    assert started(work) == [("one", ["n0.gpu0"])] and "misfit_since" not in state(client, "j")
    JobStore(client, "j").finish("one", work.launched[0][1].attempt)
    client.delete(keys.gang("n0.gpu0"))
    enqueue(client, spec, exp("two"))
    mark_unhealthy(client, "n0.gpu0", 20 * GiB, "after a run")
    dispatch(client, work)
    client.hset(keys.job_state("j"), "misfit_since", time.time() - dispatch_module.HELD_GRACE_S + 5)
    dispatch(client, work)
    assert client.exists(keys.job_spec("j"))  # not yet
    client.hset(keys.job_state("j"), "misfit_since", time.time() - dispatch_module.HELD_GRACE_S - 1)
    dispatch(client, work)
    assert not client.exists(keys.job_spec("j")) and len(work.launched) == 1
    [failed] = events(client, "j")
    assert failed["kind"] == "failed" and failed["usage"] is True
    assert failed["error"] == ("two needs 1 node(s) x 1 slot(s), which for 10 minutes only slots out of tuning "
                               "could give: n0.gpu0 (20.0 GiB used by other processes); free those GPUs, or leave "
                               "them out (CUDA_VISIBLE_DEVICES for the embedded cluster, or stop their slot "
                               "workers), and run the command again: nothing measured is lost")


def test_strict_fifo_only_while_every_job_asks_for_it(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, make_slot("n0", 0), make_slot("n0", 1))
    client.set(keys.gang("n0.gpu1"), "other/x#1")  # held by someone whose end is unknown
    strict = make_spec(tmp_path, "j1", policy="strict_fifo")
    active(client, work, strict, exp("wide", gpus=2), exp("narrow"))
    dispatch(client, work)
    assert work.launched == []  # nothing passes the blocked head
    assert state(client, "j1")["head"] == "wide"
    assert state(client, "j1")["head_waits"].startswith("needs 1 node(s) x 2 free slot(s) at once")
    submit(client, work, make_spec(tmp_path, "j2"))  # a backfilling job: the pass backfills
    dispatch(client, work)
    assert started(work) == [("narrow", ["n0.gpu0"])]
    assert state(client, "j1")["head"] == "wide" and state(client, "j1")["running"] == "narrow"
    assert state(client, "j2") == {"results_dir": str(tmp_path / "j2"), "pending": "0", "running": "-",
                                   "head": "-", "head_waits": "-", "updated": state(client, "j2")["updated"]}


MIXED_PASS = """
import json, sys
import redis
from scheduler.cluster.dispatch import dispatch
from scheduler.cluster.job_store import JobStore, reserve_seqs
from scheduler.cluster.jobs import JobSpec, submit
from scheduler.cluster.launches import QueuedLaunch
from scheduler.search.space import Experiment
from workers.state import keys
from workers.state.registry import announce_slot
from workers.device.slot import Slot

class Work:
    started = []
    def launch(self, ranks, finish, limit, shown): self.started.append(finish.name)
    def advance(self, job): pass

client, root = redis.Redis(unix_socket_path=sys.argv[1]), sys.argv[2]
for device in (0, 1):
    slot = Slot("n0", device, "cpu", 2**30, "10.0.0.1", 1, (device,))
    announce_slot(client, slot)
client.set(keys.gang("n0.gpu1"), "other/x#1")
for job, policy, wide in (("j1", "strict_fifo", 2), ("j2", "backfill", 1)):
    spec = JobSpec(job=job, results_root=root + "/" + job, cwd=root, timeout_s=100.0, experiments=[], policy=policy)
    submit(client, Work(), spec)
    exps = [Experiment(f"{job}-wide", 0, 1, 1, {}, num_gpus=wide), Experiment(f"{job}-narrow", 0, 2, 1, {})]
    first = reserve_seqs(client, 2)
    JobStore(client, job).queue([QueuedLaunch(first + i, e.to_json(), ["t.py"]) for i, e in enumerate(exps)])
dispatch(client, Work())
print(json.dumps(Work.started))
"""


@pytest.mark.parametrize("hash_seed", ["0", "1"])
def test_a_mixed_pass_backfills_whatever_the_set_order(client: redis.Redis, work, tmp_path: Path,
                                                       hash_seed: str) -> None:
    """The policies the jobs ask for are a set, whose order depends on the hash seed: two child
    processes with seeds that order {"backfill", "strict_fifo"} differently (on CPython) both backfill."""
    socket = client.connection_pool.connection_kwargs["path"]
    # The pass also runs here once on an empty cluster: mutmut maps a test to the functions it calls in
    # its own process, and would otherwise never run this test against dispatch's mutants.
    dispatch(client, work)
    assert work.launched == []
    child = subprocess.run([sys.executable, "-c", MIXED_PASS, socket, str(tmp_path)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": hash_seed}, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    # j1's strict head blocks nothing when the pass backfills: j1-narrow takes the free slot, before j2's launches
    assert json.loads(child.stdout.splitlines()[-1]) == ["j1-narrow"]


def test_a_lost_race_for_the_slots_ends_the_pass(client: redis.Redis, work, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Another reserver takes the first placement's slot between the read and the reservation."""
    register(client, make_slot("n0", 0), make_slot("n0", 1))

    class Racing(RedisSlotStore):
        def reserve(self, queues, lease_s, owner=""):
            client.set(keys.gang(queues[0]), "racer#1", nx=True)
            return super().reserve(queues, lease_s, owner)

    monkeypatch.setattr(dispatch_module, "RedisSlotStore", Racing)
    active(client, work, make_spec(tmp_path), exp("a"), exp("b"))
    dispatch(client, work)
    assert work.launched == [] and client.hlen(keys.job_running("j")) == 0
    assert client.get(keys.gang("n0.gpu0")) == b"racer#1" and not client.exists(keys.gang("n0.gpu1"))
    assert sorted(client.hkeys(keys.job_queue("j"))) == [b"a", b"b"] and state(client, "j")["head"] == "a"


def test_cancel_stops_every_running_launch_and_then_waits_for_their_clean_ups(client: redis.Redis, work,
                                                                             tmp_path: Path) -> None:
    """Ctrl-C's cancel: each running launch revoked, its slots freed, the kill of its recorded
    groups started; the job ended; then the wait for those kills (the command exits next, and its
    exit stopped one halfway: SIGABRT)."""
    spec = make_spec(tmp_path)
    submit(client, work, spec)
    gangs = GangReservations(client)
    token = gangs.reserve(["n0.gpu0"], 30.0, "j/a")
    JobStore(client, "j").update_running(RunningLaunch(1, exp("a"), ["t.py"], "att", ["n0.gpu0"], token,
                                                       {"n0.gpu0": "task-a"}, 1.0, 2.0))
    cancel(client, work, "j")
    assert work.revoked == ["task-a"] and work.cleaned == ["a"] and gangs.held(["n0.gpu0"]) == set()
    assert work.waited_for_clean_ups == [["a"]]  # once, after every clean-up had started
    assert load_spec(client, "j") is None


def test_the_cluster_lock(client: redis.Redis) -> None:
    lock = cluster_lock(client)
    assert (lock.name, lock.timeout, lock.blocking_timeout, lock.sleep) == ("autotune:lock:dispatch", 120.0, 240.0, 0.001)
    with lock:
        assert 110_000 < client.pttl("autotune:lock:dispatch") <= 120_000
        assert not cluster_lock(client).acquire(blocking=False)
    assert not client.exists("autotune:lock:dispatch")


def test_placement_honours_the_slot_kind_and_memory(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, make_slot("c", 0, "cuda", memory=80 * GiB, cuda_index=0), make_slot("n0", 0, memory=GiB),
             make_slot("n0", 1, memory=4 * GiB))
    active(client, work, make_spec(tmp_path, "cpu", slot_kind="cpu"),
           exp("roomy", memory=2 * GiB, metric_file="model_info.json"), exp("small"))
    active(client, work, make_spec(tmp_path, "any"), exp("anywhere"))
    dispatch(client, work)
    assert started(work) == [("roomy", ["n0.gpu1"]), ("small", ["n0.gpu0"]), ("anywhere", ["c.gpu0"])]
    roomy_ranks, roomy = work.launched[0][:2]
    assert roomy.metric_file == "model_info.json" and roomy_ranks[0].spec.metric_file == "model_info.json"
    assert work.launched[2][0][0].spec.cuda_devices == ["0"]


def test_a_misfit_in_its_grace_period_holds_back_nothing_else(client: redis.Redis, work, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch's clock is fixed here: the grace period ends exactly REFUSE_GRACE_S after the misfit began."""
    monkeypatch.setattr(dispatch_module, "time", SimpleNamespace(time=lambda: 5000.04))
    register(client, make_slot("n0", 0))
    active(client, work, make_spec(tmp_path), exp("wide", gpus=2), exp("fits"))
    client.hset(keys.job_state("j"), mapping={"dispatched": 1, "misfit_since": 5000.04 - REFUSE_GRACE_S})
    dispatch(client, work)
    assert events(client, "j") == [] and started(work) == [("fits", ["n0.gpu0"])]
    assert running(client, "j")["fits"].started == 5000.04
    assert running(client, "j")["fits"].deadline == 5000.04 + 100 + 20
    shown = state(client, "j")
    assert (shown["head"], shown["running"], shown["updated"]) == ("wide", "fits", "5000.0")
    client.hset(keys.job_state("j"), "misfit_since", 5000.04 - REFUSE_GRACE_S - 0.01)
    dispatch(client, work)
    assert [e["kind"] for e in events(client, "j")] == ["failed"]


def test_a_job_with_a_resource_pool_starts_only_inside_it(client: redis.Redis, work, tmp_path: Path) -> None:
    """A job's experiments reserve only the slots of its pool (JobSpec.allowed, the
    --hostfile/--include/--exclude of the command); another job may use the rest."""
    register(client, make_slot("n0", 0), make_slot("n0", 1), make_slot("n1", 0))
    active(client, work, make_spec(tmp_path, allowed=["n1.gpu0", "n9.gpu0"]), exp("a"), exp("b"))
    active(client, work, make_spec(tmp_path, "other"), exp("o"))
    dispatch(client, work)
    assert sorted(started(work)) == [("a", ["n1.gpu0"]), ("o", ["n0.gpu0"])]
    assert state(client, "j")["head"] == "b"  # waits for its pool's slot, not for n0.gpu1, which is free


# ---------------------------------------------------------------- pinned jobs


def test_a_pinned_job_runs_on_exactly_its_slots_one_at_a_time(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, make_slot("n0", 0), make_slot("n0", 1))
    spec = make_spec(tmp_path, pinned=[["n0.gpu1"]])
    active(client, work, spec, exp("a"), exp("b"))
    dispatch(client, work)
    assert started(work) == [("a", ["n0.gpu1"])]
    token = client.get(keys.gang("n0.gpu1")).decode()
    assert token.startswith("j/a#") and not client.exists(keys.gang("n0.gpu0"))
    assert work.launched[0][1].gang_token == token and running(client, "j")["a"].token == token
    assert 20_000 < client.pttl(keys.gang("n0.gpu1")) <= 30_000
    assert state(client, "j")["head"] == "b" and client.hkeys(keys.job_queue("j")) == [b"b"]


def test_a_pinned_job_waits_while_its_slot_is_busy(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, make_slot("n0", 0), make_slot("n0", 1))
    client.set(keys.gang("n0.gpu1"), "other/x#1")
    active(client, work, make_spec(tmp_path, pinned=[["n0.gpu1"]]), exp("a"))
    free = make_spec(tmp_path, "free")
    active(client, work, free, exp("f"))
    dispatch(client, work)
    assert started(work) == [("f", ["n0.gpu0"])]
    assert client.exists(keys.job_spec("j")) and state(client, "j")["head"] == "a"


def test_a_pinned_job_on_a_missing_slot_is_refused_once(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, make_slot("n0", 0))
    active(client, work, make_spec(tmp_path, pinned=[["n0.gpu0", "n0.gpu3"]]), exp("a"), exp("b"))
    other = make_spec(tmp_path, "other")
    active(client, work, other, exp("o"))
    dispatch(client, work)
    assert events(client, "j") == [{"kind": "failed", "usage": True, "error":
                                    "no live slot worker for n0.gpu3: start `celery -A tasks worker -Q gpu<i> "
                                    "-n gpu<i>@<host>` there, or change the selection"}]
    assert not client.exists(keys.job_spec("j"), keys.job_state("j"), keys.job_queue("j"))
    assert client.zrange(keys.JOBS, 0, -1) == [b"other"] and started(work) == [("o", ["n0.gpu0"])]


# ---------------------------------------------------------------- refusal of shapes the cluster lacks


def test_a_job_that_never_launched_is_refused_at_once_and_once(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, make_slot("n0", 0), make_slot("n0", 1))
    active(client, work, make_spec(tmp_path), exp("fits"), exp("wide", gpus=3), exp("wider", gpus=4))
    other = make_spec(tmp_path, "other")
    active(client, work, other, exp("o"))
    dispatch(client, work)
    error = ("wide needs 1 node(s) x 3 slot(s) but the cluster has 1 node(s) with at most 2 slot(s) each; "
             "use --num_nodes 1 --num_gpus 2 or fewer")
    assert events(client, "j") == [{"kind": "failed", "error": error, "usage": True}]
    assert not client.exists(keys.job_state("j"), keys.job_spec("j"))  # nothing published after the end
    assert started(work) == [("o", ["n0.gpu0"])]  # "fits" belonged to the refused job


def test_a_job_submitted_again_after_redis_lost_it_waits_for_its_slots_to_register(
        client: redis.Redis, work, tmp_path: Path) -> None:
    """Redis restarted without its data: the submitter submits the job again before the workers'
    next heartbeat registers their slots; refusing it then ended a job that was running fine."""
    submit(client, work, make_spec(tmp_path), launched_before=True)
    enqueue(client, make_spec(tmp_path), exp("a"))
    dispatch(client, work)
    assert events(client, "j") == [] and client.exists(keys.job_spec("j"))
    register(client, make_slot("n0", 0))
    dispatch(client, work)
    assert started(work) == [("a", ["n0.gpu0"])]


def test_a_shape_that_fits_again_clears_the_misfit(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, make_slot("n0", 0))
    client.set(keys.gang("n0.gpu0"), "other/x#1")
    active(client, work, make_spec(tmp_path), exp("a"))
    client.hset(keys.job_state("j"), mapping={"dispatched": 1, "misfit_since": 5.0})
    dispatch(client, work)
    assert not client.hexists(keys.job_state("j"), "misfit_since") and work.launched == []


# ---------------------------------------------------------------- the chord callback's bookkeeping


def _dispatched(client: redis.Redis, work, tmp_path: Path, name: str = "a") -> FinishSpec:
    register(client, make_slot("n0", 0), make_slot("n0", 1))
    active(client, work, make_spec(tmp_path), exp(name, 2, 8, gpus=2))
    dispatch(client, work)
    return work.launched[-1][1]


def test_record_finished_frees_closes_and_tells_once(client: redis.Redis, work, tmp_path: Path) -> None:
    finish = _dispatched(client, work, tmp_path)
    record = {"name": "a", "status": "ok", "wall_s": 12.5, "metrics": {"throughput": 3.0}}
    assert record_finished(client, finish, record) is True
    assert not client.exists(keys.gang("n0.gpu0"), keys.gang("n0.gpu1"))
    assert client.hlen(keys.job_running("j")) == 0 and client.smembers(keys.job_recorded("j")) == {b"a"}
    assert client.hgetall(keys.job_walls("j")) == {b"2/8": b"[12.5]"}
    assert events(client, "j") == [{"kind": "record", "record": record}]
    assert record_finished(client, finish, record) is False  # stale: closed already
    assert events(client, "j") == [{"kind": "record", "record": record}]
    assert client.hgetall(keys.job_walls("j")) == {b"2/8": b"[12.5]"}


def test_recording_and_the_steps_reads_are_one_round_trip(client: redis.Redis, work, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The chord callback frees, closes, tells and reads what the job's step needs in one round
    trip (each was one of its own on the way to the next experiment), and the reads see the close."""
    finish = _dispatched(client, work, tmp_path)
    sends = []
    original = redis.connection.AbstractConnection.send_packed_command
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command",
                        lambda self, command, *args, **kwargs: (sends.append(1), original(self, command, *args, **kwargs)))
    recorded, read = record_and_read(client, finish, {"name": "a", "status": "ok", "wall_s": 2.0})
    monkeypatch.undo()
    assert recorded and len(sends) == 1
    assert read is not None and read.spec is not None and "a" in read.recorded and "a" not in read.running
    assert read == JobStore(client, "j").step_reads()
    assert not client.exists(keys.gang("n0.gpu0")) and client.hgetall(keys.job_walls("j")) == {b"2/8": b"[2.0]"}
    assert record_and_read(client, finish, {"name": "a", "status": "ok", "wall_s": 2.0}) == (False, None)


@pytest.mark.parametrize("record", [{"status": "oom", "wall_s": 3.0}, {"status": "ok", "wall_s": 0},
                                    {"status": "ok"}, {"wall_s": 4.0}])
def test_only_a_measured_ok_run_counts_as_a_wall_time(client: redis.Redis, work, tmp_path: Path, record) -> None:
    finish = _dispatched(client, work, tmp_path)
    assert record_finished(client, finish, record) is True
    assert not client.exists(keys.job_walls("j")) and events(client, "j") == [{"kind": "record", "record": record}]


def test_a_stale_finish_frees_only_its_own_slots(client: redis.Redis, work, tmp_path: Path) -> None:
    finish = _dispatched(client, work, tmp_path)
    client.set(keys.gang("n0.gpu1"), "newer#1")  # its slot was given to a newer launch meanwhile
    JobStore(client, "j").give_up(running(client, "j")["a"])
    assert record_finished(client, finish, {"status": "ok", "wall_s": 1.0}) is False
    assert client.keys(keys.gang("*")) == [keys.gang("n0.gpu1").encode()]
    assert client.get(keys.gang("n0.gpu1")) == b"newer#1" and events(client, "j") == []
    other = FinishSpec.from_json({**finish.to_json(), "attempt": "another"})
    JobStore(client, "j").update_running(RunningLaunch(1, exp("a", 2, 8), [], "current", [], "t", {}, 0, 0))
    assert record_finished(client, other, {"status": "ok", "wall_s": 1.0}) is False
    assert "a" in running(client, "j") and not client.exists(keys.job_walls("j"))


def test_a_launch_not_started_for_a_busy_gpu_frees_its_slots_and_waits_again(client: redis.Redis, work,
                                                                              tmp_path: Path) -> None:
    """`gpu_busy` in Redis: the launch's slots are freed and it waits again uncounted in the job's
    Redis store (what the job's state becomes: tests/unit/test_sweep_decisions.py); a second
    callback of the same launch is stale and changes nothing."""
    finish = _dispatched(client, work, tmp_path)
    assert client.hget(keys.job_attempts("j"), "a") == b"1"
    busy = [{"slot": "n0.gpu1", "status": "gpu_busy", "device_foreign_bytes": 20 * GiB}]
    assert requeue_for_busy_gpu(client, finish, busy) is True
    assert not client.keys(keys.gang("*")) and client.hlen(keys.job_running("j")) == 0
    assert client.hget(keys.job_attempts("j"), "a") == b"0" and client.hexists(keys.job_queue("j"), "a")
    assert len(events(client, "j")) == 1
    assert requeue_for_busy_gpu(client, finish, busy) is False
    assert client.hget(keys.job_attempts("j"), "a") == b"0" and len(events(client, "j")) == 1


# ---------------------------------------------------------------- lost launches, found by the sweep


def test_the_attempt_cap_ends_in_lost(client: redis.Redis, work, tmp_path: Path) -> None:
    """A launch that never reports is retried while attempts remain, then recorded `lost`, once."""
    spec = make_spec(tmp_path, "capped", timeout_s=1.0, max_attempts=3)
    submit(client, work, spec)
    register(client, make_slot("n", 0))
    launch = enqueue(client, spec, exp("z0_gas1_tmbspg1"))[0]
    gangs, store = GangReservations(client), JobStore(client, "capped")
    outcomes = []
    for attempt in range(1, 4):
        token = gangs.reserve(["n.gpu0"], 30)
        assert token is not None
        store.start(launch, RunningLaunch(1, launch.exp, ["t.py"], f"att{attempt}", ["n.gpu0"], token,
                                          {"n.gpu0": f"task{attempt}"}, time.time() - 100, time.time() - 1,
                                          {"n.gpu0": "inst-n-0"}))
        outcomes.append(sweep(client, work))
        assert gangs.held(["n.gpu0"]) == set()  # every lost launch frees its slot
        assert client.hexists(keys.job_queue("capped"), launch.name) is (attempt < 3), f"attempt {attempt}"
    assert outcomes == [set(), set(), {"capped"}]
    assert work.revoked == ["task1", "task2", "task3"]
    record = json.loads((tmp_path / "capped" / launch.name / "result.json").read_text())
    assert record["status"] == "lost" and record["cause"]["error"] == (
        "no record from the slot workers within the time limit plus 20s (a worker or node died, or Redis lost "
        "the task); gave up after 3 attempts")
    assert client.smembers(keys.job_recorded("capped")) == {launch.name.encode()}
    # recorded once; with nothing running or queued its step is due at every sweep (and would end it)
    assert sweep(client, work) == {"capped"} and len(events(client, "capped")) == 1


def test_sweep_checks_every_running_launch_of_every_job(client: redis.Redis, work, tmp_path: Path) -> None:
    register(client, make_slot("n0", 0), make_slot("n0", 1), make_slot("n0", 2))
    now = time.time()
    specs = {job: make_spec(tmp_path, job, max_attempts=1, lease_s=120.0) for job in ("j1", "j2", "j3")}
    gangs = GangReservations(client)
    for i, (job, spec) in enumerate(specs.items()):
        submit(client, work, spec)
        token = gangs.reserve([f"n0.gpu{i}"], 60)
        due = now - 1 if job != "j2" else now + 500
        JobStore(client, job).update_running(RunningLaunch(1, exp(f"e{i}"), ["t.py"], "att", [f"n0.gpu{i}"], token,
                                                           {f"n0.gpu{i}": f"t{i}"}, now, due,
                                                           {f"n0.gpu{i}": f"inst-n0-{i}"}))
    client.hset(keys.job_attempts("j3"), "e2", 1)
    assert sweep(client, work) == {"j3"}  # j1's first attempt waits again; j3's is recorded lost
    assert sorted(work.revoked) == ["t0", "t2"] and gangs.held(["n0.gpu0", "n0.gpu1", "n0.gpu2"]) == {"n0.gpu1"}
    assert client.hkeys(keys.job_queue("j1")) == [b"e0"] and client.smembers(keys.job_recorded("j3")) == {b"e2"}
    assert list(running(client, "j2")) == ["e1"]
    # a launch whose lease lapsed while its rank stayed silent is lost too
    client.delete(keys.gang("n0.gpu1"))
    JobStore(client, "j2").update_running(replace(running(client, "j2")["e1"], started=now - 200))
    client.hset(keys.job_attempts("j2"), "e1", 1)
    assert sweep(client, work) == {"j2", "j3"} and work.revoked[-1] == "t1"  # j3: nothing running or queued
    assert json.loads((tmp_path / "j2" / "e1" / "result.json").read_text())["cause"]["error"] == (
        "the lease of n0.gpu1 expired: its rank stopped renewing it (worker or node gone); gave up after 1 attempts")
    JobStore(client, "j2").update_running(RunningLaunch(1, exp("e1"), ["t.py"], "att2", ["n0.gpu1"], "x",
                                                        {"n0.gpu1": "t1"}, time.time(), now + 500,
                                                        {"n0.gpu1": "inst-n0-1"}))
    # a slot whose worker vanished is noted in the running launch by the sweep itself
    client.delete(keys.slot("n0.gpu1"))
    assert sweep(client, work) == {"j3"}  # not j2: its launch is not lost yet
    assert running(client, "j2")["e1"].missing_since is not None


def test_a_finalist_runs_with_its_node_otherwise_idle_and_co_runners_are_recorded(client: redis.Redis, work,
                                                                                   tmp_path: Path) -> None:
    """Two jobs on nodes n0 and n1 (2 slots each). j1's `a` runs on n0.gpu0; j2 queues `b`, its
    finalist's re-measurement `fin` (exclusive) and `c`: b goes beside a (n0.gpu1), fin to n1, idle,
    and c waits although n1.gpu1 is free: nothing runs beside fin, in this pass or the next. When b
    is recorded, c takes n0.gpu1. a and b each record the other as a co-runner, fin none."""
    register(client, make_slot("n0", 0), make_slot("n0", 1), make_slot("n1", 0), make_slot("n1", 1))
    one, two = make_spec(tmp_path, "j1"), make_spec(tmp_path, "j2")
    active(client, work, one, exp("a"))
    dispatch(client, work)
    active(client, work, two, exp("b"), {**exp("fin"), "exclusive": True}, exp("c"))
    dispatch(client, work)
    assert started(work) == [("a", ["n0.gpu0"]), ("b", ["n0.gpu1"]), ("fin", ["n1.gpu0"])]
    dispatch(client, work)
    assert len(work.launched) == 3  # c still waits: n1.gpu1 is free but fin runs on n1
    assert running(client, "j1")["a"].co_runners == ["j2/b"]
    assert running(client, "j2")["b"].co_runners == ["j1/a"] and running(client, "j2")["fin"].co_runners == []
    finish_b = work.launched[1][1]
    assert co_runners_of(client, finish_b) == ["j1/a"]
    assert co_runners_of(client, FinishSpec.from_json({**finish_b.to_json(), "attempt": "older"})) == []
    assert record_finished(client, finish_b, {"name": "b", "status": "ok", "wall_s": 1.0})
    dispatch(client, work)
    assert started(work)[-1] == ("c", ["n0.gpu1"])
    assert running(client, "j1")["a"].co_runners == ["j2/b", "j2/c"]


def test_a_gang_of_gpus_takes_the_nvlink_pair_and_its_record_names_the_link(client: redis.Redis, work,
                                                                           tmp_path: Path) -> None:
    """GPUs 1 and 2 of a 3-GPU node are NVLinked, the rest meet over the host bridge: a 2-GPU
    experiment takes 1 and 2, and the chord callback is told the gang's slowest link."""
    links = {0: ((1, "PHB"), (2, "PHB")), 1: ((0, "PHB"), (2, "NV12")), 2: ((0, "PHB"), (1, "NV12"))}
    register(client, *(replace(make_slot("n0", d, kind="cuda", cuda_index=d), links=links[d]) for d in range(3)))
    active(client, work, make_spec(tmp_path), exp("pair", gpus=2))
    dispatch(client, work)
    [(ranks, finish, _, _)] = work.launched
    assert finish.slots == ["n0.gpu1", "n0.gpu2"] and finish.gpu_link == "NV12"


def test_the_record_of_a_launch_redis_forgot_answers_its_experiment(client: redis.Redis, work, tmp_path: Path) -> None:
    """Redis lost its data mid-launch; the job was submitted again and waited for the launch, whose
    ranks ran on. Its record is adopted: the experiment is recorded and the job told, once. A stale
    finish of an experiment the job runs, queues or recorded itself is not."""
    finish = _dispatched(client, work, tmp_path)
    client.delete(keys.job_running("j"))  # what Redis lost; the job spec is back (submitted again)
    record = {"name": "a", "status": "ok", "wall_s": 2.0, "metrics": {"throughput": 3.0}}
    assert record_finished(client, finish, record) is True
    assert client.smembers(keys.job_recorded("j")) == {b"a"} and events(client, "j")[-1] == {"kind": "record",
                                                                                           "record": record}
    assert record_finished(client, finish, record) is False  # recorded: once
    assert len([e for e in events(client, "j") if e["kind"] == "record"]) == 1
    spec = make_spec(tmp_path)
    enqueue(client, spec, exp("b", 2, 8))
    other = FinishSpec.from_json({**finish.to_json(), "name": "b"})
    assert record_finished(client, other, {"name": "b", "status": "ok"}) is False  # queued: a newer launch will run


def test_a_job_waiting_only_for_a_launch_redis_forgot_is_stepped_by_the_sweep(client: redis.Redis, work,
                                                                              tmp_path: Path) -> None:
    """The job, submitted again after Redis lost its data, waits for a launch whose ranks ran on; if
    its record never comes (its chord went with the data), no callback steps the job when the leases
    lapse: with nothing running or queued, its step is due at every sweep. A job with work in flight
    is stepped by that work's events, not by the sweep."""
    register(client, make_slot("n0", 0))
    spec = make_spec(tmp_path)
    [a] = active(client, work, spec, exp("a", 2, 8))
    assert sweep(client, work) == set()  # queued: a dispatch starts it, its callback steps the job
    dispatch(client, work)
    assert list(running(client, "j")) == ["a"] and sweep(client, work) == set()  # running, not lost
    client.delete(keys.job_running("j"))  # what Redis lost: the job knows no launch of its own now
    assert sweep(client, work) == {"j"}
    JobStore(client, "j").queue([a])
    assert sweep(client, work) == set()


def test_a_fixed_run_says_when_its_launch_waits_for_a_busy_gpu(client: redis.Redis, work, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """`python -m scheduler.run` (jobs.run_fixed) tells its user why the run has not started."""
    def answer(job: str) -> None:  # the control worker's answer to the job's first step
        store = JobStore(client, job)
        store.publish({"kind": "gpu_busy", "name": "run", "slots": ["n0.gpu1 (20.0 GiB used by other processes)"]})
        store.publish({"kind": "done"})

    work.advance = answer
    spec = make_spec(tmp_path, experiments=[{**exp("run"), "argv": ["t.py"]}])
    with caplog.at_level(logging.WARNING, logger="scheduler.cluster.jobs"):
        run_fixed(client, work, spec)
    assert caplog.messages == ["run not started: other processes hold memory on n0.gpu1 (20.0 GiB used by "
                               "other processes); it waits until that memory goes"]
