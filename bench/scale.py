"""The control path at cluster scale: 1,024 registered slots and 10,000 queued experiments.

What runs: a real redis-server (private, free port) holding 1,024 slot registrations (128 nodes x 8
GPUs, as slot workers write them) and four tuning jobs of 2,500 experiments each (1, 2, 4 and 8 GPUs
per experiment), queued by the real job step (`scheduler.cluster.progress.advance`: the search replayed,
experiment configs built, queue entries written). Then the real `scheduler.cluster.dispatch.dispatch`, with the
real Celery app sending its chords to Redis (no worker consumes them: only the control path is timed):

- queueing: the first step of each job (10,000 experiments in all);
- a saturated pass: every slot held by someone else, nothing can start, 10,000 waiting (what every
  completion and every 2 s sweep pays while a big job waits);
- passes after a completion: one node's 8 slots freed, dispatch fills them (p50 / p99 over 40 passes);
- Redis memory per registered slot and per queued experiment (INFO used_memory deltas).

    .venv/bin/python bench/scale.py [--nodes 128] [--gpus 8] [--per-job 2500] [--passes 40]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "integration" / "scripts" / "fake_train.py"
GiB = 2**30


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    from scheduler.embedded.local_cluster import free_tcp_port

    port, password = free_tcp_port(), secrets.token_hex(8)
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password,
                             "--save", "", "--appendonly", "no"], cwd=workdir, stdout=subprocess.DEVNULL)
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def register_slots(client: redis.Redis, nodes: int, gpus: int) -> list[str]:
    from workers.state.registry import announce_slot
    from workers.device.slot import Slot

    queues = []
    pipe = client.pipeline(transaction=False)
    for n in range(nodes):
        for d in range(gpus):
            slot = Slot(f"node{n:03d}", d, "cuda", 80 * GiB, f"10.0.{n // 250}.{n % 250 + 1}", 4, (), f"gpu{d}@node{n:03d}",
                        instance=secrets.token_hex(6), cuda_index=d)
            announce_slot(pipe, slot, ttl_s=3600)  # as a slot's heartbeat does (indexed)
            queues.append(slot.queue)
    pipe.execute()
    return queues


def submit_job(client: redis.Redis, messages, root: Path, name: str, num_gpus: int, count: int) -> str:
    from scheduler.cluster.jobs import JobSpec, TuneSpec, submit

    folder = root / name
    folder.mkdir()
    config = {"train_micro_batch_size_per_gpu": list(range(1, count + 1)), "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0},
              "autotuning": {"enabled": True, "metric": "throughput", "results_dir": str(folder / "results"),
                             "exps_dir": str(folder / "exps"),
                             "model_info": {"num_params": 1000, "trainable_num_params": 1000,
                                            "activation_mem_per_gpu": 1}}}
    (folder / "cfg.json").write_text(json.dumps(config))
    (folder / "results").mkdir()
    spec = JobSpec(job=name, results_root=str(folder / "results"), cwd=str(folder), timeout_s=900.0,
                   slot_kind="cuda",
                   tune=TuneSpec(config_path=str(folder / "cfg.json"), ds_config=config, exps_dir=str(folder / "exps"),
                                 script=str(FAKE), base_args=[], mappings={}, capacity_bytes=80 * GiB, num_nodes=1,
                                 num_gpus=num_gpus, device_kind="gpu", concurrency=8 // num_gpus))
    submit(client, messages, spec)
    return name


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--per-job", type=int, default=2500)
    parser.add_argument("--passes", type=int, default=40)
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        print("redis-server is needed (deploy/setup.sh installs it)")
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    server, url = start_redis(work)
    try:
        os.environ["AUTOTUNE_REDIS_URL"] = url
        from scheduler.cluster.dispatch import dispatch
        from scheduler.cluster.progress import advance
        from tasks import app
        from tasks.work import CeleryWork
        from workers.state import keys
        from workers.state.gang import GangReservations

        client = redis.Redis.from_url(url)
        messages = CeleryWork(app)
        base = used_memory(client)
        queues = register_slots(client, args.nodes, args.gpus)
        per_slot = (used_memory(client) - base) / len(queues)
        gangs = GangReservations(client)
        tokens = {q: gangs.reserve([q], 3600, owner="other") for q in queues}  # a saturated cluster
        jobs = [submit_job(client, messages, work, f"job{g}", g, args.per_job) for g in (1, 2, 4, 8)]
        before_queue = used_memory(client)
        started = time.perf_counter()
        if os.environ.get("BENCH_PROFILE"):
            import cProfile
            cProfile.runctx("advance(client, jobs[0])", globals(), locals(), "/tmp/queue.prof")
        for job in jobs:
            advance(client, job)
        queueing = time.perf_counter() - started
        queued = sum(client.hlen(keys.job_queue(job)) for job in jobs)
        per_queued = (used_memory(client) - before_queue) / max(1, queued)

        if os.environ.get("BENCH_PROFILE"):
            import cProfile
            import pstats
            cProfile.runctx("dispatch(client, messages)", globals(), locals(), "/tmp/scale.prof")
            pstats.Stats("/tmp/scale.prof").sort_stats("cumulative").print_stats(25)
        saturated = []
        for _ in range(5):
            t = time.perf_counter()
            dispatch(client, messages)
            saturated.append(time.perf_counter() - t)
        assert sum(client.hlen(keys.job_running(job)) for job in jobs) == 0

        from scheduler.cluster.backfill import POLICIES

        decisions: list[float] = []

        def timed(policy):
            def timed_policy(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return policy(*args, **kwargs)
                finally:
                    decisions.append(time.perf_counter() - t)
            return timed_policy
        timed_policies = {name: timed(policy) for name, policy in POLICIES.items()}  # the decision alone
        rng = random.Random(1)
        passes, started_total = [], 0
        for _ in range(args.passes):
            node = rng.randrange(args.nodes)
            freed = [q for q in queues if q.startswith(f"node{node:03d}.") and tokens.get(q)]
            for q in freed:
                gangs.release([q], tokens.pop(q))
            running_before = sum(client.hlen(keys.job_running(job)) for job in jobs)
            t = time.perf_counter()
            if os.environ.get("BENCH_PROFILE") and not passes:
                import cProfile
                cProfile.runctx("dispatch(client, messages)", globals(), locals(), "/tmp/pass.prof")
            else:
                dispatch(client, messages, timed_policies)
            passes.append(time.perf_counter() - t)
            started_total += sum(client.hlen(keys.job_running(job)) for job in jobs) - running_before
        ms = sorted(p * 1000 for p in passes)
        print(f"{len(queues)} slots ({args.nodes} nodes x {args.gpus} GPUs), {queued} queued experiments "
              f"in {len(jobs)} jobs (1, 2, 4, 8 GPUs each)")
        print(f"queueing {queued} experiments (first step of each job): {queueing:.2f} s")
        print(f"saturated dispatch pass (nothing can start): median {statistics.median(saturated) * 1000:.1f} ms")
        print(f"dispatch pass after a node's 8 slots free: p50 {statistics.median(ms):.1f} ms, "
              f"p99 {ms[min(len(ms) - 1, int(0.99 * len(ms)))]:.1f} ms, max {ms[-1]:.1f} ms "
              f"({started_total} experiments started in {len(ms)} passes)")
        if not decisions:
            print("error: no placement decision was timed: scheduler.cluster.dispatch no longer calls the policies it is "
                  "given", file=sys.stderr)
            return 1
        decided = sorted(d * 1000 for d in decisions)
        print(f"placement decision (the backfill policy over the waiting heads): p50 {statistics.median(decided):.2f} ms, "
              f"p99 {decided[min(len(decided) - 1, int(0.99 * len(decided)))]:.2f} ms")
        print(f"Redis memory: {per_slot:.0f} B per registered slot, {per_queued:.0f} B per queued experiment")
    finally:
        sys.stdout.flush()
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    code = main()
    os._exit(code)  # the chords' AsyncResults would try to unsubscribe from the stopped Redis at exit
