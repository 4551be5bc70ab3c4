"""Whole dispatch passes (`scheduler.cluster.dispatch.dispatch_in`) over the in-memory stores, with no
redis-server: what starts where, in which order, and what each launch is sent and recorded with.

The stores keep the Redis stores' contract (tests/redis/*_contract.py); what only Redis has (the
Lua scripts, a pass's raw keys and round trips, the cluster lock) stays in tests/redis/test_dispatch.py.
Refusals, pinned jobs and slots out of tuning: tests/unit/test_dispatch_refusals.py. Every
expectation is worked out by hand.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from memory_cluster import GiB, SLOT_CLOCK, Cluster, exp, make_slot, make_spec
from scheduler.cluster.jobs import TuneSpec
from scheduler.cluster.launches import FinishSpec, RunningLaunch
from workers.slot.op_prebuild import PREBUILD_TIMEOUT_S
from workers.slot.rank_spec import RankSpec
from workers.state.memory_store import InMemorySlotStore

HEX32 = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


def test_a_launch_whose_ops_are_built_first_gets_the_build_time_on_its_limits(cluster: Cluster,
                                                                               tmp_path: Path) -> None:
    """A config with Adam (no torch_adam) has FusedAdam built before its script
    (workers.slot.op_prebuild, up to PREBUILD_TIMEOUT_S); that time is not the script's, so neither the
    lost-launch deadline nor Celery's hard limit may run out during it. A config with torch_adam
    builds nothing and keeps the plain limits."""
    cluster.register(make_slot("n0", 0), make_slot("n0", 1))
    fused, plain = exp("fused"), exp("plain")
    fused["ds_config"]["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
    plain["ds_config"]["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}
    cluster.active(make_spec(tmp_path), fused, plain)
    cluster.dispatch()
    limits = {finish.name: limit for _, finish, limit, _ in cluster.work.launched}
    assert limits == {"fused": 100 + PREBUILD_TIMEOUT_S + 300, "plain": 100 + 300}
    launched = cluster.running("j")
    assert launched["fused"].deadline == launched["fused"].started + 100 + 20 + PREBUILD_TIMEOUT_S
    assert launched["plain"].deadline == launched["plain"].started + 100 + 20


def test_a_launch_on_gpus_gets_its_waits_for_a_free_gpu_on_its_limits(cluster: Cluster, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank on a GPU may wait AUTOTUNE_GPU_WAIT_S for others' memory to go before its script and
    again after it (workers.slot.rank): not the script's time, so not on its deadline either."""
    monkeypatch.setenv("AUTOTUNE_GPU_WAIT_S", "7")
    cluster.register(make_slot("n0", 0, "cuda", 80 * GiB, cuda_index=0))
    cluster.active(make_spec(tmp_path), exp("gpu"))
    cluster.dispatch()
    assert cluster.work.launched[0][2] == 100 + 14 + 300
    assert cluster.running("j")["gpu"].deadline == cluster.running("j")["gpu"].started + 100 + 20 + 14


def test_a_launch_is_recorded_before_it_is_sent_with_what_its_ranks_need(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(make_slot("n0", 0), make_slot("n0", 1))
    spec = make_spec(tmp_path, local_rank_arg=True)
    a, b, c = cluster.active(spec, exp("a", 1, 2), exp("b"), exp("c"))
    before = time.time()
    cluster.dispatch()
    after = time.time()
    assert cluster.started() == [("a", ["n0.gpu0"]), ("b", ["n0.gpu1"])]
    assert cluster.work.running_at_send == [{"a"}, {"a", "b"}]  # each in the store before its chord went
    ranks, finish, limit, shown = cluster.work.launched[0]
    token = cluster.lease("n0.gpu0")
    assert token is not None and token.startswith("j/a#") and cluster.lease("n0.gpu1").startswith("j/b#")
    assert cluster.lapses_at("n0.gpu0") == cluster.lapses_at("n0.gpu1") == SLOT_CLOCK + 30  # the job's lease
    assert HEX32.fullmatch(finish.attempt) and limit == 100 + 300 and shown == \
        "(experiment='a', job='j', slots=['n0.gpu0'])"
    assert finish == FinishSpec(job="j", name="a", exp_id=1, attempt=finish.attempt, slots=["n0.gpu0"],
                                gang_token=token, results_root=spec.results_root, world_size=1,
                                ds_config=a.exp["ds_config"], timeout_s=100.0, metric_file="metrics.json",
                                shape=f"{a.exp['stage']}/{a.exp['micro_batch_size']}")
    assert cluster.work.launched[1][1].exp_id == 2 and cluster.work.launched[1][1].attempt != finish.attempt
    [rank] = ranks
    assert rank.queue == "n0.gpu0" and HEX32.fullmatch(rank.task_id)
    assert rank.shown == "(experiment='a', rank=0, slot='n0.gpu0')"
    description = {"name": "a", "exp_id": 1, "ds_config": a.exp["ds_config"], "num_gpus": 1, "num_nodes": 1,
                   "result_dir": f"{os.path.realpath(spec.results_root)}/a", "slots": ["n0.gpu0"],
                   "user_script": "train.py", "user_args": ["--flag", "a"]}
    assert rank.spec == RankSpec(job="j", name="a", attempt=finish.attempt, results_root=spec.results_root,
                                 script_argv=a.argv, ds_config=a.exp["ds_config"], rank=0, world_size=1,
                                 local_rank=0, local_world_size=1, node_rank=0, timeout_s=100.0,
                                 cwd=str(tmp_path), metric_file="metrics.json", exp=description,
                                 gang_token=token, lease_s=30.0, cuda_devices=[], local_rank_arg=True)
    launched = cluster.running("j")
    assert sorted(launched) == ["a", "b"]
    rec = launched["a"]
    assert before <= rec.started <= after and rec.deadline == rec.started + 100 + 20
    assert rec == RunningLaunch(seq=a.seq, exp=a.exp, argv=a.argv, attempt=finish.attempt, queues=["n0.gpu0"],
                                token=token, rank_tasks={"n0.gpu0": rank.task_id}, started=rec.started,
                                deadline=rec.deadline, instances={"n0.gpu0": "inst-n0-0"}, missing_since=None,
                                co_runners=["j/b"])  # b started beside it on node n0, after it
    assert launched["b"].co_runners == ["j/a"]  # and a ran there already
    store = cluster.jobs.store("j")
    assert store.queued_names() == {"c"} and store.attempts() == {"a": 1, "b": 1}
    shown = cluster.state("j")
    assert before - 0.1 <= float(shown.pop("updated")) <= after + 0.1
    assert shown == {"dispatched": "1", "exp_ids": "2", "results_dir": spec.results_root, "pending": "1",
                     "running": "a,b", "head": "c",
                     "head_waits": "needs 1 node(s) x 1 free slot(s) at once; the slots that fit are reserved"}
    assert not (tmp_path / "j").exists()  # a fixed job writes no experiment descriptions


def test_ranks_of_a_two_node_gang(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(make_slot("n0", 0, "cuda", cuda_index=5), make_slot("n0", 1, "cuda", cuda_index=7),
                     make_slot("n1", 0, "cuda", cuda_index=1), make_slot("n1", 1, "cuda", cuda_index=3),
                     make_slot("n1", 2, "cuda", cuda_index=4))
    exps_dir = tmp_path / "exps"
    tune = TuneSpec(str(tmp_path / "cfg.json"), {}, str(exps_dir), "train.py", [], {}, GiB, 2, 2, "cuda", 1)
    [big] = cluster.active(make_spec(tmp_path, tune=tune), exp("big", 2, 4, nodes=2, gpus=2))
    cluster.dispatch()
    [(ranks, finish, _, _)] = cluster.work.launched
    queues = ["n0.gpu0", "n0.gpu1", "n1.gpu0", "n1.gpu1"]
    assert finish.slots == queues and finish.world_size == 4
    assert [(r.queue, r.spec.rank, r.spec.local_rank, r.spec.local_world_size, r.spec.node_rank,
             r.spec.world_size, r.spec.cuda_devices, r.spec.num_nodes) for r in ranks] == [
        ("n0.gpu0", 0, 0, 2, 0, 4, ["5", "7"], 2), ("n0.gpu1", 1, 1, 2, 0, 4, ["5", "7"], 2),
        ("n1.gpu0", 2, 0, 2, 1, 4, ["1", "3"], 2), ("n1.gpu1", 3, 1, 2, 1, 4, ["1", "3"], 2)]
    assert [r.shown for r in ranks][3] == "(experiment='big', rank=3, slot='n1.gpu1')"
    assert len({r.task_id for r in ranks}) == 4 and all(r.spec.exp["slots"] == queues for r in ranks)
    assert cluster.running("j")["big"].rank_tasks == {r.queue: r.task_id for r in ranks}
    assert cluster.running("j")["big"].instances == {q: f"inst-{q.replace('.gpu', '-')}" for q in queues}
    assert json.loads((exps_dir / "big.json").read_text()) == {
        "name": "big", "ds_config": big.exp["ds_config"], "num_gpus": 2, "num_nodes": 2}
    shown = cluster.state("j")
    assert (shown["head"], shown["head_waits"], shown["running"], shown["pending"]) == ("-", "-", "big", "0")


def test_fifo_across_jobs_by_submission_order(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(make_slot("n0", 0))
    one, two = make_spec(tmp_path, "j1"), make_spec(tmp_path, "j2")
    cluster.submit(one)
    cluster.submit(two)
    cluster.enqueue(two, exp("early2"))  # seq 3 (the two jobs took 1 and 2): the later job's launch first
    cluster.enqueue(one, exp("late1"))
    cluster.dispatch()
    assert cluster.started() == [("early2", ["n0.gpu0"])]
    assert cluster.state("j1")["head"] == "late1" and cluster.state("j2")["running"] == "early2"
    assert cluster.state("j1")["running"] == "-"


def test_only_the_free_slots_bound_what_starts(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(*(make_slot("n0", d) for d in range(4)))
    cluster.hold("n0.gpu2", "other/x#1")
    cluster.active(make_spec(tmp_path), *(exp(f"e{i}") for i in range(5)))
    cluster.dispatch()
    assert cluster.started() == [("e0", ["n0.gpu0"]), ("e1", ["n0.gpu1"]), ("e2", ["n0.gpu3"])]
    assert cluster.lease("n0.gpu2") == "other/x#1" and cluster.lapses_at("n0.gpu2") is None
    assert cluster.state("j")["pending"] == "2" and cluster.state("j")["head"] == "e3"


def test_strict_fifo_only_while_every_job_asks_for_it(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(make_slot("n0", 0), make_slot("n0", 1))
    cluster.hold("n0.gpu1", "other/x#1")  # held by someone whose end is unknown
    cluster.active(make_spec(tmp_path, "j1", policy="strict_fifo"), exp("wide", gpus=2), exp("narrow"))
    cluster.dispatch()
    assert cluster.work.launched == []  # nothing passes the blocked head
    assert cluster.state("j1")["head"] == "wide"
    assert cluster.state("j1")["head_waits"].startswith("needs 1 node(s) x 2 free slot(s) at once")
    cluster.submit(make_spec(tmp_path, "j2"))  # a backfilling job: the pass backfills
    cluster.dispatch()
    assert cluster.started() == [("narrow", ["n0.gpu0"])]
    assert cluster.state("j1")["head"] == "wide" and cluster.state("j1")["running"] == "narrow"
    assert cluster.state("j2") == {"results_dir": str(tmp_path / "j2"), "pending": "0", "running": "-",
                                   "head": "-", "head_waits": "-", "updated": cluster.state("j2")["updated"]}


MIXED_PASS = """
import json, sys
sys.path.insert(0, sys.argv[2])
from memory_cluster import Cluster, exp, make_slot, make_spec
from pathlib import Path

cluster = Cluster()
cluster.register(make_slot("n0", 0), make_slot("n0", 1))
cluster.hold("n0.gpu1", "other/x#1")
for job, policy, wide in (("j1", "strict_fifo", 2), ("j2", "backfill", 1)):
    cluster.active(make_spec(Path(sys.argv[1]), job, policy=policy), exp(f"{job}-wide", gpus=wide),
                   exp(f"{job}-narrow", mbs=2))
cluster.dispatch()
print(json.dumps([name for name, _ in cluster.started()]))
"""


@pytest.mark.parametrize("hash_seed", ["0", "1"])
def test_a_mixed_pass_backfills_whatever_the_set_order(cluster: Cluster, tmp_path: Path, hash_seed: str) -> None:
    """The policies the jobs ask for are a set, whose order depends on the hash seed: two child
    processes with seeds that order {"backfill", "strict_fifo"} differently (on CPython) both backfill."""
    # The pass also runs here once on an empty cluster: mutmut maps a test to the functions it calls in
    # its own process, and would otherwise never run this test against dispatch's mutants.
    cluster.dispatch()
    assert cluster.work.launched == []
    child = subprocess.run([sys.executable, "-c", MIXED_PASS, str(tmp_path), str(Path(__file__).parent)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": hash_seed},
                           timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    # j1's strict head blocks nothing when the pass backfills: j1-narrow takes the free slot, before j2's launches
    assert json.loads(child.stdout.splitlines()[-1]) == ["j1-narrow"]


def test_a_lost_race_for_the_slots_ends_the_pass(tmp_path: Path) -> None:
    """Another reserver takes the first placement's slot between the read and the reservation."""
    class Racing(InMemorySlotStore):
        def reserve(self, queues: list[str], lease_s: float, owner: str = "") -> str | None:
            if self.db.leases.get(queues[0]) is None:
                self.db.leases.set(queues[0], "racer#1")
            return super().reserve(queues, lease_s, owner)

    cluster = Cluster(Racing)
    cluster.register(make_slot("n0", 0), make_slot("n0", 1))
    cluster.active(make_spec(tmp_path), exp("a"), exp("b"))
    cluster.dispatch()
    assert cluster.work.launched == [] and cluster.running("j") == {}
    assert cluster.lease("n0.gpu0") == "racer#1" and cluster.lease("n0.gpu1") is None
    assert cluster.jobs.store("j").queued_names() == {"a", "b"} and cluster.state("j")["head"] == "a"


def test_placement_honours_the_slot_kind_and_memory(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(make_slot("c", 0, "cuda", memory=80 * GiB, cuda_index=0), make_slot("n0", 0, memory=GiB),
                     make_slot("n0", 1, memory=4 * GiB))
    cluster.active(make_spec(tmp_path, "cpu", slot_kind="cpu"),
                   exp("roomy", memory=2 * GiB, metric_file="model_info.json"), exp("small"))
    cluster.active(make_spec(tmp_path, "any"), exp("anywhere"))
    cluster.dispatch()
    assert cluster.started() == [("roomy", ["n0.gpu1"]), ("small", ["n0.gpu0"]), ("anywhere", ["c.gpu0"])]
    roomy_ranks, roomy = cluster.work.launched[0][:2]
    assert roomy.metric_file == "model_info.json" and roomy_ranks[0].spec.metric_file == "model_info.json"
    assert cluster.work.launched[2][0][0].spec.cuda_devices == ["0"]


def test_a_job_with_a_resource_pool_starts_only_inside_it(cluster: Cluster, tmp_path: Path) -> None:
    """A job's experiments reserve only the slots of its pool (JobSpec.allowed, the
    --hostfile/--include/--exclude of the command); another job may use the rest."""
    cluster.register(make_slot("n0", 0), make_slot("n0", 1), make_slot("n1", 0))
    cluster.active(make_spec(tmp_path, allowed=["n1.gpu0", "n9.gpu0"]), exp("a"), exp("b"))
    cluster.active(make_spec(tmp_path, "other"), exp("o"))
    cluster.dispatch()
    assert sorted(cluster.started()) == [("a", ["n1.gpu0"]), ("o", ["n0.gpu0"])]
    assert cluster.state("j")["head"] == "b"  # waits for its pool's slot, not for n0.gpu1, which is free


def test_a_finalist_runs_with_its_node_otherwise_idle_and_co_runners_are_recorded(cluster: Cluster,
                                                                                   tmp_path: Path) -> None:
    """Two jobs on nodes n0 and n1 (2 slots each). j1's `a` runs on n0.gpu0; j2 queues `b`, its
    finalist's re-measurement `fin` (exclusive) and `c`: b goes beside a (n0.gpu1), fin to n1, idle,
    and c waits although n1.gpu1 is free: nothing runs beside fin, in this pass or the next. When b
    is recorded, c takes n0.gpu1. a and b each record the other as a co-runner, fin none."""
    cluster.register(make_slot("n0", 0), make_slot("n0", 1), make_slot("n1", 0), make_slot("n1", 1))
    cluster.active(make_spec(tmp_path, "j1"), exp("a"))
    cluster.dispatch()
    cluster.active(make_spec(tmp_path, "j2"), exp("b"), {**exp("fin"), "exclusive": True}, exp("c"))
    cluster.dispatch()
    assert cluster.started() == [("a", ["n0.gpu0"]), ("b", ["n0.gpu1"]), ("fin", ["n1.gpu0"])]
    cluster.dispatch()
    assert len(cluster.work.launched) == 3  # c still waits: n1.gpu1 is free but fin runs on n1
    assert cluster.running("j1")["a"].co_runners == ["j2/b"]
    assert cluster.running("j2")["b"].co_runners == ["j1/a"] and cluster.running("j2")["fin"].co_runners == []
    finish_b = cluster.work.launched[1][1]
    assert cluster.jobs.store("j2").finish("b", finish_b.attempt) is not None  # what the chord callback does
    assert cluster.slots.release(finish_b.slots, finish_b.gang_token) == 1
    cluster.dispatch()
    assert cluster.started()[-1] == ("c", ["n0.gpu1"])
    assert cluster.running("j1")["a"].co_runners == ["j2/b", "j2/c"]


def test_a_gang_of_gpus_takes_the_nvlink_pair_and_its_record_names_the_link(cluster: Cluster,
                                                                           tmp_path: Path) -> None:
    """GPUs 1 and 2 of a 3-GPU node are NVLinked, the rest meet over the host bridge: a 2-GPU
    experiment takes 1 and 2, and the chord callback is told the gang's slowest link."""
    links = {0: ((1, "PHB"), (2, "PHB")), 1: ((0, "PHB"), (2, "NV12")), 2: ((0, "PHB"), (1, "NV12"))}
    cluster.register(*(replace(make_slot("n0", d, kind="cuda", cuda_index=d), links=links[d]) for d in range(3)))
    cluster.active(make_spec(tmp_path), exp("pair", gpus=2))
    cluster.dispatch()
    [(_, finish, _, _)] = cluster.work.launched
    assert finish.slots == ["n0.gpu1", "n0.gpu2"] and finish.gpu_link == "NV12"
