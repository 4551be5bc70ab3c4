"""Cluster-wide dispatch, run by the control workers: which queued experiment starts now, and where.

Event-driven: dispatch runs after a job is submitted and after every recorded experiment (in the
chord callback), so a freed slot is reused at once; the control worker's sweep (`scheduler.cluster.sweep`)
only catches what no event announces: lost launches, slots freed by an expired lease, workers that
(re)appeared. One Redis lock (`cluster_lock`) serialises every planning step across control
workers; the gang reservation itself is atomic anyway, so a slot can never be double-booked.

An experiment marked `exclusive` (a finalist's re-measurement, `scheduler.search.repeats.confirm`)
starts only on nodes where no slot is busy, and while it runs every slot of its nodes counts as
busy for everyone else: the finalists are compared with their nodes otherwise idle. Each launch
keeps its co-runners (the launches of any job holding a slot on its nodes when it starts, and those
starting beside it later), which its record shows (`scheduler.cluster.co_runners`).

Order: every queued experiment of every active job, by its submission sequence number (FIFO across
jobs), with EASY backfill (`scheduler.cluster.backfill`): a later experiment starts in free slots only when
it cannot delay the waiting head past its estimated start. A job may ask for strict FIFO
(DeepSpeed's ResourceManager rule; benchmarks compare both); it is used while every active job asks
for it. A job pinned to named slots (`python -m scheduler.run` with a hostfile) waits for exactly
those. Estimates: a waiting experiment's time limit; a running one ends at its start plus the mean
wall time of finished experiments of the same (stage, micro batch) in its job, or its time limit.

A pass reads and writes through the stores only (`dispatch_in`: the slots' `BaseSlotStore`, the
jobs' `stores.BaseActiveJobs`) and sends through `Work`, so its decisions run over the in-memory
twins in tests/unit; `dispatch` is the pass over Redis.

The other ends of a launch are apart: `scheduler.cluster.finish` records how it ended (the chord
callback), `scheduler.cluster.sweep` finds the launches that will never report (lost).
"""
from __future__ import annotations

import math
import os
import time
import uuid
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from scheduler.cluster.backfill import POLICIES, Policy, Waiting, estimate_run_s
from scheduler.errors import ClusterError
from scheduler.cluster.co_runners import beside, queues_by_node
from scheduler.cluster.dispatch_reads import RedisActiveJobs
from scheduler.cluster.jobs import JobSpec
from scheduler.cluster.launches import FinishSpec, QueuedLaunch, RunningLaunch
from scheduler.report.outputs import write_experiment_descriptions
from scheduler.cluster.stores import BaseActiveJobs, BaseJobStore, Heads
from scheduler.cluster.placement import fits_ever, gang_link, is_loopback, largest_shape, pinned_placement
from scheduler.search.space import Experiment
from scheduler.cluster.work import RankLaunch, Work
from workers.state import keys
from workers.device.device_idle import gpu_wait_s
from workers.slot.op_prebuild import PREBUILD_TIMEOUT_S, needed_op_builders
from workers.files.paths import safe_child
from workers.slot.rank_spec import RankSpec
from workers.device.slot import Slot
from workers.state.store import BaseSlotStore, RedisSlotStore, describe
from workers.device.topology import worst_link

LOCK_TIMEOUT_S = 120.0
#: How often a waiting control process retries the lock: redis-py's default (100 ms) added up to
#: half a second to a step waiting behind another; a step holds it for a few ms, and two slots
#: finishing together make one chord callback wait for the other's (5 ms polls added 2.5 ms on average).
LOCK_POLL_S = 0.001
REFUSE_GRACE_S = 60.0  #: after a job's first launch, how long the cluster may lack a fitting shape
#: How long a job waits when only slots out of tuning (workers.state.slot_health) could run its experiments.
HELD_GRACE_S = 600.0
#: Celery's hard limit is only a backstop behind our own per-experiment timeout and group kill.
TIME_LIMIT_GRACE_S = 300


def cluster_lock(client: redis.Redis):
    """The lock every planning step holds (`with cluster_lock(client): ...`)."""
    return client.lock(keys.DISPATCH_LOCK, timeout=LOCK_TIMEOUT_S, blocking_timeout=2 * LOCK_TIMEOUT_S,
                       sleep=LOCK_POLL_S)


def dispatch(client: redis.Redis, work: Work, policies: Mapping[str, Policy] = POLICIES) -> None:
    """Start every queued experiment the policy allows now (module docstring), over Redis. `policies`
    are the placement policies by the name a job asks for (bench/scale.py passes timed ones)."""
    dispatch_in(RedisSlotStore(client), RedisActiveJobs(client), work, policies)


def dispatch_in(state: BaseSlotStore, jobs_store: BaseActiveJobs, work: Work,
                policies: Mapping[str, Policy] = POLICIES) -> None:
    """`dispatch` over the stores given: the slots' (`state`) and the active jobs' (`jobs_store`).

    A pass that finds fewer free slots than the smallest waiting gang needs decides nothing: it only
    checks that each waiting shape could run on the cluster at all (memoised per registration epoch,
    workers.state.slot_view) and publishes the jobs' states, so its cost does not grow with the slots."""
    specs = [JobSpec.from_json(raw) for raw in jobs_store.active_spec_jsons()]
    if not specs:
        return
    view = state.read_view()  # free slots, slots marked out of tuning (others' memory: no known end)
    slots, sick = view.slots, view.sick
    read = jobs_store.heads([spec.job for spec in specs], len(view.free))  # only what could matter now
    queued = {job: found.launches for job, found in read.items()}
    waiting = sorted(((launch.seq, spec, launch) for spec in specs for launch in queued[spec.job]),
                     key=lambda item: item[0])
    placing = bool(waiting) and len(view.free) >= min(_gang_size(spec, launch) for _, spec, launch in waiting)
    busy = view.busy() if placing else None
    free_waiting: list[tuple[JobSpec, QueuedLaunch]] = []
    started: set[tuple[str, str]] = set()  #: (job, experiment) started in this pass
    refused: set[str] = set()
    cleared: dict[str, bool] = {}
    for _, spec, launch in waiting:
        if spec.job in refused:
            continue
        if spec.pinned is not None:
            if not _start_pinned(jobs_store, state, work, spec, launch, slots, busy, started):
                refused.add(spec.job)
        elif _fits_or_refused(jobs_store.store(spec.job), spec, launch, slots, view.memo, cleared, sick):
            free_waiting.append((spec, launch))
        elif not jobs_store.store(spec.job).spec_json():
            refused.add(spec.job)
    jobs = {spec.job: spec for spec in specs if spec.job not in refused}
    if placing and free_waiting:
        assert busy is not None
        _place_and_start(jobs_store, state, work, policies, specs, jobs, free_waiting, slots, busy, sick, started)
    _publish_states(jobs_store, jobs, read, started, sick, [job for job, pending in cleared.items() if pending])


def _gang_size(spec: JobSpec, launch: QueuedLaunch) -> int:
    """The free slots a launch needs at the least (a pinned job's named slots, else nodes x slots)."""
    if spec.pinned is not None:
        return sum(len(node) for node in spec.pinned)
    return launch.exp["num_nodes"] * launch.exp["num_gpus"]


def _place_and_start(jobs_store: BaseActiveJobs, state: BaseSlotStore, work: Work, policies: Mapping[str, Policy],
                     specs: list[JobSpec],
                     jobs: dict[str, JobSpec], free_waiting: list[tuple[JobSpec, QueuedLaunch]], slots: list[Slot],
                     busy: set[str], sick: Mapping[str, dict], started: set[tuple[str, str]]) -> None:
    """Ask the policy where the waiting launches start now, reserve and start them (into `started`)."""
    # Strict FIFO only while every active job asks for it: one backfilling job makes the pass backfill.
    asked = {spec.policy for spec in specs}
    policy = policies[asked.pop()] if len(asked) == 1 else policies["backfill"]
    by_key = {f"{spec.job}/{launch.name}": (spec, launch) for spec, launch in free_waiting if spec.job in jobs}
    items = [Waiting(key, launch.exp["num_nodes"], launch.exp["num_gpus"], spec.timeout_s,
                     launch.exp.get("min_memory", 0), spec.slot_kind, bool(launch.exp.get("exclusive")),
                     pool_of(spec))
             for key, (spec, launch) in by_key.items()]
    frees_at = {**_frees_at(jobs_store, jobs, busy, slots), **dict.fromkeys(sick, math.inf)}
    by_node = queues_by_node(slots)
    for key, placement in policy(items, slots, frees_at, time.time()):
        spec, launch = by_key[key]
        queues = [slot.queue for node in placement for slot in node]
        token = state.reserve(queues, spec.lease_s, owner=key)
        if token is None:
            break  # taken between our read and now (cannot happen under the lock; be safe)
        _start(jobs_store, work, spec, launch, placement, token, by_node, busy)
        busy.update(queues)
        started.add((spec.job, launch.name))


def _publish_states(jobs_store: BaseActiveJobs, jobs: dict[str, JobSpec], read: Mapping[str, Heads],
                    started: set[tuple[str, str]], sick: Mapping[str, dict], misfits_cleared: list[str]) -> None:
    """What `python -m scheduler.autotune --status` shows for each active job (its queue and running
    launches as the pass read them, with those it started), and the misfits this pass cleared: one
    round trip."""
    shown = {}
    for job, spec in jobs.items():
        running = read[job].running | {name for started_job, name in started if started_job == job}
        depth = read[job].depth - sum(1 for started_job, _ in started if started_job == job)
        head = next((launch.exp for launch in read[job].launches if launch.name not in running), None)
        waits = (f"needs {head['num_nodes']} node(s) x {head['num_gpus']} free slot(s) at once; "
                 "the slots that fit are reserved" if head else "-")
        if head and sick:
            waits += "; out of tuning until their GPU's memory frees: " + ", ".join(
                describe(queue, mark) for queue, mark in sorted(sick.items()))
        shown[job] = {"results_dir": spec.results_root, "pending": depth, "running": ",".join(sorted(running)) or "-",
                      "head": head["name"] if head else "-", "head_waits": waits, "updated": round(time.time(), 1)}
    jobs_store.show_all(shown, misfits_cleared)


def _start_pinned(jobs_store: BaseActiveJobs, state: BaseSlotStore, work: Work, spec: JobSpec, launch: QueuedLaunch,
                  slots: list[Slot], busy: set[str] | None, started: set[tuple[str, str]]) -> bool:
    """Every experiment of a pinned job wants the same named slots: they run one after another.
    False when the job was refused (a named slot has no live worker). `busy` None: too few slots
    are free for anything (only the refusal is checked)."""
    named = spec.pinned or []
    try:
        placement = pinned_placement(slots, {q for node in named for q in node} if busy is None else busy, named)
    except ClusterError as exc:
        jobs_store.store(spec.job).end({"kind": "failed", "error": str(exc), "usage": True})
        return False
    if placement is None:
        return True
    queues = [slot.queue for node in placement for slot in node]
    token = state.reserve(queues, spec.lease_s, owner=f"{spec.job}/{launch.name}")
    if token is not None:
        assert busy is not None  # a pass that places nothing has no placement here
        _start(jobs_store, work, spec, launch, placement, token, queues_by_node(slots), busy)
        busy.update(queues)
        started.add((spec.job, launch.name))
    return True


def _fits_or_refused(store: BaseJobStore, spec: JobSpec, launch: QueuedLaunch, slots: list[Slot],
                     fits: dict[tuple, bool], cleared: dict[str, bool], sick: Mapping[str, dict]) -> bool:
    """Whether the experiment's shape fits the live cluster at all. A job is refused at once when it
    has launched nothing yet; later, slots may only be re-registering (a worker or Redis restarting),
    so the cluster gets REFUSE_GRACE_S to come back first. A shape that fits only with slots out of
    tuning (others' memory on their GPUs, workers.state.slot_health) waits for them, and the job is
    stopped, saying which, once none of its experiments could run for HELD_GRACE_S and none runs.
    `fits` remembers each shape's answers for these slots (`SlotView.memo`: until a registration
    changes), `cleared` the jobs whose misfit was cleared in this pass (True: not written yet)."""
    exp = launch.exp
    pool = pool_of(spec)
    shape = (exp["num_nodes"], exp["num_gpus"], exp.get("min_memory", 0), spec.slot_kind, pool)
    if shape not in fits:
        fits[shape] = fits_ever(slots, *shape)
    healthy = (shape, frozenset(sick))  # whether it fits without the slots marked now
    if fits[shape] and sick and healthy not in fits:
        fits[healthy] = fits_ever([s for s in slots if s.queue not in sick], *shape)
    if fits[shape] and (not sick or fits[healthy]):
        cleared.setdefault(spec.job, True)  # its misfit cleared with the states, at the pass's end
        return True
    if cleared.get(spec.job):  # cleared by an earlier launch of this pass: before this one's misfit
        store.clear_misfit()
        cleared[spec.job] = False
    now = time.time()
    since, dispatched = store.misfit_since(now)
    if fits[shape]:  # only with slots out of tuning
        if now - since > HELD_GRACE_S and not store.running_names():
            store.end({"kind": "failed", "error": held_refusal(exp, sick), "usage": True})
        return False
    if not dispatched or now - since > REFUSE_GRACE_S:
        within = slots if pool is None else [s for s in slots if s.queue in pool]
        error = refusal(exp, within, spec.slot_kind)
        if pool is not None:
            error = f"within the job's resource pool ({', '.join(sorted(pool))}): {error}"
        store.end({"kind": "failed", "error": error, "usage": True})
    return False


def pool_of(spec: JobSpec) -> frozenset[str] | None:
    """The slot queues the job's experiments may reserve (its --hostfile/--include/--exclude), None: any."""
    return None if spec.allowed is None else frozenset(spec.allowed)


def held_refusal(exp: dict[str, Any], sick: Mapping[str, dict]) -> str:
    """Why a job stopped waiting for slots out of tuning, and what to do."""
    return (f"{exp['name']} needs {exp['num_nodes']} node(s) x {exp['num_gpus']} slot(s), which for "
            f"{HELD_GRACE_S / 60:.0f} minutes only slots out of tuning could give: "
            + ", ".join(describe(queue, mark) for queue, mark in sorted(sick.items()))
            + "; free those GPUs, or leave them out (CUDA_VISIBLE_DEVICES for the embedded cluster, or "
            "stop their slot workers), and run the command again: nothing measured is lost")


def refusal(exp: dict[str, Any], slots: list[Slot], kind: str = "") -> str:
    """Why an experiment can never run here, with the largest shape that would."""
    if not slots:
        return ("no live slot workers: start them with `celery -A tasks worker -Q gpu0 -n gpu0@%h` "
                "(one per device)")
    if kind and not any(s.kind == kind for s in slots):
        return (f"{exp['name']} was sized for {kind.upper()} slots but the cluster has only "
                f"{', '.join(sorted({s.kind.upper() for s in slots}))} slots; start {kind.upper()} slot workers "
                "or run the command again to size the search for these")
    slots = [s for s in slots if not kind or s.kind == kind]
    memory = exp.get("min_memory", 0)
    fitting = [s for s in slots if s.memory_bytes >= memory]
    if not fitting:
        biggest = max(s.memory_bytes for s in slots)
        return (f"{exp['name']} needs slots with {memory / 2**30:.1f} GiB but the largest slot has "
                f"{biggest / 2**30:.1f} GiB; ask for at most that (--min-slot-memory)")
    if exp["num_nodes"] > 1:
        loopback = sorted({s.node for s in fitting if is_loopback(s.address)})
        if loopback and len({s.node for s in fitting}) >= exp["num_nodes"]:
            return (f"{exp['name']} spans {exp['num_nodes']} nodes but node(s) {', '.join(loopback)} advertise a "
                    "loopback address their peers cannot reach (they reach Redis over loopback); start their "
                    "workers with AUTOTUNE_ADDRESS=<an address the other nodes reach>")
    nodes, per_node = largest_shape(fitting)
    return (f"{exp['name']} needs {exp['num_nodes']} node(s) x {exp['num_gpus']} slot(s) but the cluster has "
            f"{nodes} node(s) with at most {per_node} slot(s) each"
            + (f" of {memory / 2**30:.1f} GiB" if memory else "")
            + f"; use --num_nodes {min(nodes, exp['num_nodes'])} --num_gpus {per_node} or fewer")


def _frees_at(jobs_store: BaseActiveJobs, jobs: dict[str, JobSpec], busy: set[str],
              slots: Sequence[Slot]) -> dict[str, float]:
    """When each busy slot should free: our jobs' running experiments from their start plus their
    shape's mean wall time (or the time limit); slots held by anything else: unknown (infinite).
    While an exclusive experiment runs (a finalist re-measured with its nodes otherwise idle), every
    slot of its nodes counts as busy until it ends, so nothing is placed beside it."""
    running = jobs_store.running_by_job(list(jobs))
    walls = jobs_store.walls_by_job({job: sorted({_shape(launch.exp) for launch in launches})
                                  for job, launches in running.items()})
    return _estimated_frees_at(jobs, running, walls, busy, slots)


def _estimated_frees_at(jobs: dict[str, JobSpec], running: Mapping[str, list[RunningLaunch]],
                        walls: Mapping[str, Mapping[str, list[float]]], busy: set[str],
                        slots: Sequence[Slot]) -> dict[str, float]:
    """`_frees_at` from what it read: each job's running launches, and the wall times of their shapes."""
    frees_at = dict.fromkeys(busy, math.inf)
    for job, spec in jobs.items():
        for launch in running[job]:
            end_at = launch.started + estimate_run_s(spec.timeout_s, walls.get(job, {}).get(_shape(launch.exp), ()))
            frees_at.update({q: end_at for q in launch.queues if q in frees_at})
            if launch.exp.get("exclusive"):
                nodes = _nodes_of(launch.queues, slots)
                frees_at.update({s.queue: end_at for s in slots if s.node in nodes and s.queue not in frees_at})
    return frees_at


def _nodes_of(queues: list[str], slots: Sequence[Slot]) -> set[str]:
    wanted = set(queues)
    return {slot.node for slot in slots if slot.queue in wanted}


def _shape(exp: dict[str, Any]) -> str:
    return f"{exp['stage']}/{exp['micro_batch_size']}"


def _start(jobs_store: BaseActiveJobs, work: Work, spec: JobSpec, queued: QueuedLaunch, placement: list[list[Slot]],
           token: str, by_node: Mapping[str, list[str]], busy: set[str]) -> None:
    """Send the experiment's chord to its reserved slots; the launch is recorded in Redis first (its
    exp_id taken there), in one transaction with the launches beside it that now name it as a co-runner."""
    exp = Experiment.from_json(queued.exp)
    queues = [slot.queue for node in placement for slot in node]
    attempt = uuid.uuid4().hex
    task_ids = {queue: uuid.uuid4().hex for queue in queues}
    now = time.time()
    build_s = PREBUILD_TIMEOUT_S if needed_op_builders(exp.ds_config) else 0.0  # before the script: workers.slot.op_prebuild
    if any(slot.kind == "cuda" for node in placement for slot in node):  # a wait for a free GPU before and after
        build_s += 2 * gpu_wait_s(os.environ.get("AUTOTUNE_GPU_WAIT_S"))  # the script (workers.device.device_idle)
    co_runners, beside_updates = beside(jobs_store, f"{spec.job}/{exp.name}", placement, by_node, busy)
    exp_id = jobs_store.start_beside(spec.job, queued, RunningLaunch(
        seq=queued.seq, exp=queued.exp, argv=queued.argv, attempt=attempt, queues=queues, token=token,
        rank_tasks=task_ids, started=now, deadline=now + spec.timeout_s + spec.lost_grace_s + build_s,
        instances={slot.queue: slot.instance for node in placement for slot in node}, co_runners=co_runners), beside_updates)
    description = {"name": exp.name, "exp_id": exp_id, "ds_config": exp.ds_config, "num_gpus": exp.num_gpus,
                   "num_nodes": exp.num_nodes, "result_dir": str(safe_child(spec.results_root, exp.name)),
                   "slots": queues, "user_script": queued.argv[0], "user_args": queued.argv[1:]}
    finish = FinishSpec(job=spec.job, name=exp.name, exp_id=exp_id, attempt=attempt, slots=queues,
                        gang_token=token, results_root=spec.results_root, world_size=len(queues),
                        ds_config=exp.ds_config, timeout_s=spec.timeout_s, metric_file=exp.metric_file,
                        gpu_link=worst_link(link for node in placement if (link := gang_link(node))),
                        shape=_shape(queued.exp))
    ranks = []
    for node_rank, node_slots in enumerate(placement):
        cuda_devices = [str(slot.cuda_index) for slot in node_slots if slot.kind == "cuda"]
        for local_rank, slot in enumerate(node_slots):
            rank_spec = RankSpec(
                job=spec.job, name=exp.name, attempt=attempt, results_root=spec.results_root,
                script_argv=queued.argv, ds_config=exp.ds_config,
                rank=sum(len(n) for n in placement[:node_rank]) + local_rank, world_size=len(queues),
                local_rank=local_rank, local_world_size=len(node_slots), node_rank=node_rank,
                num_nodes=len(placement), timeout_s=spec.timeout_s, cwd=spec.cwd, metric_file=exp.metric_file, exp=description,
                gang_token=token, lease_s=spec.lease_s, cuda_devices=cuda_devices,
                local_rank_arg=spec.local_rank_arg)
            ranks.append(RankLaunch(slot.queue, rank_spec, task_ids[slot.queue],
                                    f"(experiment={exp.name!r}, rank={rank_spec.rank}, slot={slot.queue!r})"))
    work.launch(ranks, finish, int(spec.timeout_s + build_s) + TIME_LIMIT_GRACE_S,
                f"(experiment={exp.name!r}, job={spec.job!r}, slots={queues!r})")
    if spec.tune is not None:  # DeepSpeed's autotuning_exps/<name>.json, for each experiment launched
        write_experiment_descriptions(Path(spec.tune.exps_dir), [exp])  # after the chord: not on its way
