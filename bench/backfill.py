"""Strict FIFO (DeepSpeed's ResourceManager) vs EASY backfill on the same mixed-gang workload.

THIS IS A SIMULATION OF THE SCHEDULING POLICY, NOT A MEASUREMENT OF CELERY: a discrete-event loop
feeds the two pure decision functions of `scheduler.cluster.backfill` (the ones dispatch calls) with
simulated time. No Redis, no workers, no launch or rendezvous overhead, no polling delay: the
only difference between the two rows is which experiment the policy starts when. A later
benchmark measures the same comparison on real workers.

Workload (deterministic, seeded): 4 slots on 2 nodes; experiments submitted at t=0 in a shuffled
order, a mix of 1-slot runs, 1 node x 2 gangs and 2 nodes x 2 gangs; run times log-normal around
60 s; each one's estimate is its time limit = run time x U(1.2, 3.0), so the policy plans with
estimates that overstate the truth, as time limits do. Dispatch happens at t=0 and at every
completion, like the event-driven dispatch on the control worker.

Printed per policy: makespan, slot utilisation = busy slot-seconds / (slots x makespan), mean wait
(start - submission), and "late heads": experiments that started after the time promised to them
when they became the head of the queue (must be 0: backfill may never delay the head).

    .venv/bin/python bench/backfill.py [--seed 1] [--experiments 40] [--seeds 50]
"""
from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass

from scheduler.cluster.backfill import Policy, Waiting, backfill, reservation, strict_fifo
from workers.device.slot import Slot

SHAPES = [((1, 1), 0.5), ((1, 2), 0.3), ((2, 2), 0.2)]  #: (nodes, slots per node), share
EPS = 1e-9


@dataclass(frozen=True)
class Job:
    """One simulated experiment: its gang shape, its true run time and its time limit (estimate)."""

    name: str
    num_nodes: int
    num_gpus: int
    run_s: float
    limit_s: float

    @property
    def size(self) -> int:
        return self.num_nodes * self.num_gpus


@dataclass(frozen=True)
class Outcome:
    """What one policy did with the workload."""

    makespan_s: float
    utilisation: float
    mean_wait_s: float
    late_heads: int


def cluster(nodes: int = 2, per_node: int = 2) -> list[Slot]:
    return [Slot(f"node{n}", d, "cuda", 80 * 1024**3, f"10.0.0.{n + 1}", 8, ())
            for n in range(nodes) for d in range(per_node)]


def workload(seed: int, count: int) -> list[Job]:
    """`count` jobs in submission order, the same for a given seed."""
    rng = random.Random(seed)
    shapes, weights = zip(*SHAPES)
    jobs = []
    for i in range(count):
        nodes, gpus = rng.choices(shapes, weights)[0]
        run_s = round(rng.lognormvariate(4.1, 0.6), 1)  # median ~60 s
        jobs.append(Job(f"e{i:02d}_{nodes}x{gpus}", nodes, gpus, run_s, round(run_s * rng.uniform(1.2, 3.0), 1)))
    return jobs


def simulate(policy: Policy, jobs: list[Job], slots: list[Slot]) -> Outcome:
    """Run the workload to completion under `policy`, dispatching at t=0 and at every completion."""
    by_name = {job.name: job for job in jobs}
    waiting = list(jobs)
    ends: list[tuple[float, str, list[str]]] = []  # (true end, name, queues), a heap
    frees_at: dict[str, float] = {}  # busy queue -> start + time limit: what the policy is told
    started: dict[str, float] = {}
    promised: dict[str, float] = {}
    now = 0.0
    while waiting or ends:
        queue = [Waiting(job.name, job.num_nodes, job.num_gpus, job.limit_s) for job in waiting]
        for name, placement in policy(queue, slots, frees_at, now):
            job = by_name[name]
            queues = [slot.queue for node in placement for slot in node]
            frees_at.update(dict.fromkeys(queues, now + job.limit_s))
            heapq.heappush(ends, (now + job.run_s, name, queues))
            started[name] = now
            waiting.remove(job)
        _promise_head(waiting, slots, frees_at, now, promised)
        if not ends:
            raise RuntimeError(f"{waiting[0].name} can never start on {len(slots)} slots")
        now = ends[0][0]
        while ends and ends[0][0] <= now + EPS:
            _, _, queues = heapq.heappop(ends)
            for queue_name in queues:
                del frees_at[queue_name]
    busy = sum(job.run_s * job.size for job in jobs)
    late = sum(1 for name, at in promised.items() if started[name] > at + EPS)
    return Outcome(now, busy / (len(slots) * now), statistics.fmean(started.values()), late)


def _promise_head(waiting: list[Job], slots: list[Slot], frees_at: dict[str, float], now: float,
                  promised: dict[str, float]) -> None:
    """Remember the start time first promised to the job at the head of the queue."""
    if waiting and waiting[0].name not in promised:
        head = waiting[0]
        held = reservation(Waiting(head.name, head.num_nodes, head.num_gpus, head.limit_s), slots, frees_at, now)
        if held is not None:
            promised[head.name] = held.start_at


def describe(jobs: list[Job], slots: list[Slot]) -> str:
    counts = {f"{n}x{g}": sum(1 for j in jobs if (j.num_nodes, j.num_gpus) == (n, g)) for (n, g), _ in SHAPES}
    nodes = len({slot.node for slot in slots})
    runs = sorted(job.run_s for job in jobs)
    return (f"{len(slots)} slots on {nodes} nodes; {len(jobs)} experiments (nodes x slots: "
            + ", ".join(f"{k} = {v}" for k, v in counts.items())
            + f"); run time {runs[0]:.0f}-{runs[-1]:.0f} s (median {statistics.median(runs):.0f} s); "
            "estimate = time limit = run time x U(1.2, 3.0)")


def table(fifo: Outcome, easy: Outcome) -> str:
    rows = [("policy", "makespan s", "utilisation", "mean wait s", "late heads"),
            ("strict FIFO (DeepSpeed)", f"{fifo.makespan_s:.0f}", f"{fifo.utilisation:.1%}",
             f"{fifo.mean_wait_s:.0f}", str(fifo.late_heads)),
            ("EASY backfill (ours)", f"{easy.makespan_s:.0f}", f"{easy.utilisation:.1%}",
             f"{easy.mean_wait_s:.0f}", str(easy.late_heads)),
            ("backfill / FIFO", f"{easy.makespan_s / fifo.makespan_s:.2f}x",
             f"{easy.utilisation / fifo.utilisation:.2f}x", f"{easy.mean_wait_s / fifo.mean_wait_s:.2f}x", "")]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i])
                       for i, cell in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def spread(seeds: range, count: int, slots: list[Slot]) -> str:
    """Backfill/FIFO ratios over many seeded workloads, so one lucky seed cannot carry the claim."""
    util, span, wait, late = [], [], [], 0
    for seed in seeds:
        jobs = workload(seed, count)
        fifo, easy = simulate(strict_fifo, jobs, slots), simulate(backfill, jobs, slots)
        util.append(easy.utilisation / fifo.utilisation)
        span.append(easy.makespan_s / fifo.makespan_s)
        wait.append(easy.mean_wait_s / fifo.mean_wait_s)
        late += fifo.late_heads + easy.late_heads
    return (f"over {len(seeds)} seeds (backfill / FIFO):\n  utilisation  {_range(util)}\n"
            f"  makespan     {_range(span)}\n  mean wait    {_range(wait)}\n  late heads   {late} in total")


def _range(ratios: list[float]) -> str:
    return f"min {min(ratios):.2f}x  median {statistics.median(ratios):.2f}x  max {max(ratios):.2f}x"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="workload of the main table")
    parser.add_argument("--experiments", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=50, help="workloads for the spread line")
    args = parser.parse_args(argv)
    slots = cluster()
    jobs = workload(args.seed, args.experiments)
    print("SIMULATION of the dispatch policy (scheduler.cluster.backfill), not a measurement of Celery workers.")
    print(describe(jobs, slots) + f"; seed {args.seed}\n")
    print(table(simulate(strict_fifo, jobs, slots), simulate(backfill, jobs, slots)))
    print()
    print(spread(range(args.seeds), args.experiments, slots))


if __name__ == "__main__":
    main()
