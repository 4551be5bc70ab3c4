"""Worker start-up and shutdown: bind a slot worker to its device and register it.

`celery -A tasks worker -Q gpu0 -n gpu0@%h`: when the worker starts, the bare `gpu0` becomes this
node's `<node>.gpu0` queue, the slot is described (GPU via nvidia-smi, else a CPU slot with a memory
cap and thread budget) and registered in Redis with a heartbeat, which withdraws the slot while the
worker's consumer has stopped taking its queue's messages (`workers.slot.consumer_watch`). This happens
in the main process before the pool forks, so pool children inherit the binding through the
environment and the worker itself never initialises CUDA. A worker on `-Q control` registers as a
control worker and, once its pool is up, runs the sweep thread
(`scheduler.cluster.control_loop.sweep_forever`).
A pool process that shuts down ends its slot's warm interpreter first (`workers.warm.warm_start`).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import replace
from typing import NoReturn
from urllib.parse import urlparse

import psutil
import redis
from celery import signals
from celery.exceptions import TimeLimitExceeded
from celery.worker import state as worker_state

from workers.state import keys
from workers.slot.consumer_watch import STUCK_ENV, STUCK_S, ConsumerWatch
from workers.device.cuda_binding import binding_problem, should_check, uuid_seen_by_cuda
from workers.device.device_idle import seconds_setting
from workers.device.gpus import GpuListingError, memory_used
from workers.process.launch import group_runs_slot, kill_group
from workers.process.process_identity import leftover_groups
from workers.state.redis_tls import describe_tls_failure
from workers.state.connection import connect
from workers.state.store import RedisSlotStore, Running
from workers.device.slot import Slot, address_towards, describe_local_slot, node_name, parse_queue, slot_queue
from workers.warm.warm_start import WARM
from scheduler.embedded.worker_command import CONTROL_QUEUE

log = logging.getLogger(__name__)
_heartbeats: list[Running] = []
_stop_sweeping = threading.Event()


def redis_client(conf) -> redis.Redis:
    return connect(conf.broker_url)


_task_clients: dict[tuple[int, str], redis.Redis] = {}


def task_client(conf) -> redis.Redis:
    """The Redis client of this process's tasks, one per process (its pool reconnects after a Redis
    restart). A client per task opened a connection per task (connect, AUTH, HELLO and redis-py's
    CLIENT SETINFO, which reads the package's metadata from disk): milliseconds at both ends of
    every experiment, between its slot's previous run and its start (bench/dispatch_overhead.py)."""
    key = (os.getpid(), conf.broker_url)  # a forked pool child opens its own
    client = _task_clients.get(key)
    if client is None:
        client = _task_clients[key] = connect(conf.broker_url)
    return client


@signals.celeryd_init.connect
def refuse_without_redis(sender: str | None = None, **_: object) -> None:
    """A worker without AUTOTUNE_REDIS_URL would silently serve a Redis on 127.0.0.1:6379, and one
    with a wrong password would retry for minutes with a traceback: refuse at once, one line, exit 2.
    An unreachable Redis is not refused (Celery retries: Redis may be starting)."""
    from deploy.plan import check_redis_url
    from workers.state.redis_url import masked_url as masked
    from scheduler.errors import UsageError

    try:
        url = check_redis_url(os.environ.get("AUTOTUNE_REDIS_URL"))
    except UsageError as exc:
        _refuse_at_start(f"worker {sender}: {exc}")
    try:
        connect(url).ping()
    except redis.AuthenticationError:
        _refuse_at_start(f"worker {sender}: Redis at {masked(url)} refused the password in AUTOTUNE_REDIS_URL; "
                "use the one given to redis-server --requirepass")
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "AUTH" in str(exc):
            _refuse_at_start(f"worker {sender}: Redis at {masked(url)} rejected AUTH ({exc}); put its password "
                    "in AUTOTUNE_REDIS_URL as redis://:PASSWORD@HOST:PORT/0")
        raise
    except redis.RedisError as exc:
        refused = describe_tls_failure(exc)
        if refused:  # a certificate that does not verify will not start verifying: no retrying
            _refuse_at_start(f"worker {sender}: {refused}")
        log.warning("Redis at %s is not reachable yet (%s); retrying", masked(url), exc)


def _refuse_at_start(message: str) -> NoReturn:
    """Before Celery set up logging: exactly one line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(2)


@signals.celeryd_after_setup.connect
def bind_and_register(sender: str, instance, conf, **_: object) -> None:
    queues = instance.app.amqp.queues
    node = node_name(sender)
    client = redis_client(conf)
    slot_queues = [(name, parse_queue(name)) for name in list(queues.consume_from)]
    slot_queues = [(name, parsed) for name, parsed in slot_queues if parsed is not None]
    if len(slot_queues) > 1:
        raise SystemExit("a slot worker serves exactly one device: give one -Q gpu<i>")
    if slot_queues:
        name, (queue_node, device) = slot_queues[0]
        if queue_node is None:
            queues.select_add(slot_queue(node, device))
            queues.deselect([name])
        elif queue_node != node:
            node = queue_node
        host, port = _redis_host_port(conf.broker_url)
        try:
            described = describe_local_slot(node, device, address_towards(host, port), worker=sender)
        except GpuListingError as exc:
            _refuse(f"slot worker {sender}: {exc}")
        slot = replace(described, instance=uuid.uuid4().hex[:12])
        if slot.kind == "cuda" and should_check():  # CUDA and nvidia-smi must agree on the GPU
            seen = uuid_seen_by_cuda(slot)
            problem = binding_problem(slot, seen)
            if problem:
                _refuse(f"slot worker {sender}: {problem}")
            if seen is None:
                log.warning("slot %s: could not ask CUDA which GPU its ranks will open; not checked", slot.queue)
        os.environ["AUTOTUNE_SLOT_JSON"] = json.dumps(slot.to_redis())
        os.environ.update({k: v for k, v in slot.child_env().items() if k.startswith("CUDA_")})
        orphans = kill_orphans(client, slot.queue)
        if orphans:
            log.warning("killed %d training process group(s) left by an earlier worker of %s",
                        orphans, slot.queue)
        slots = RedisSlotStore(client)
        twin = slots.claim_gpu(slot)
        if twin is not None:
            _refuse(f"slot worker {sender}: GPU {slot.cuda_index} ({slot.gpu_uuid}) is already served by slot "
                    f"{twin.get('queue')} (worker {twin.get('worker')}) on this machine; one slot worker per GPU: "
                    "stop one, or give each worker its own GPU (gpu<i>, CUDA_VISIBLE_DEVICES)")
        watch = ConsumerWatch(waiting=lambda queue=slot.queue: client.llen(queue), busy=_holds_a_task,
                              stuck_s=seconds_setting(os.environ.get(STUCK_ENV), STUCK_S))
        _heartbeats.append(slots.register_slot(slot, withheld=watch))
        if slot.kind == "cuda" and slot.cuda_index >= 0:  # lifts the slot's mark when its GPU is free
            _heartbeats.append(slots.watch_health(slot.queue, slot.nvidia_smi_id, memory_used))
        log.info("slot %s registered: %s", slot.queue, slot)
        print(f"slot {slot.queue} registered: {slot.kind} device {slot.device}, "
              f"{slot.memory_bytes / 2**30:.1f} GiB, address {slot.address}", flush=True)
    if CONTROL_QUEUE in queues.consume_from:
        _heartbeats.append(RedisSlotStore(client).register_control(node, sender))
        print(f"control worker {sender} registered", flush=True)
    parent = os.environ.get("AUTOTUNE_EXIT_WITH_PARENT")
    if parent:
        threading.Thread(target=exit_with_parent, args=(int(parent),), daemon=True,
                         name="exit with parent").start()


def _holds_a_task() -> bool:
    """Whether this worker has a task in hand (received and not yet done): its queue may then hold
    the next one without anything being wrong (`workers.slot.consumer_watch`)."""
    return bool(worker_state.active_requests or worker_state.reserved_requests)


def _refuse(message: str) -> NoReturn:
    """End the worker at start-up with one line on stderr and exit status 2 (bad input, not a crash)."""
    log.error("%s", message)
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(2)


def exit_with_parent(parent_pid: int) -> None:
    """Embedded-cluster workers end with their autotuner, even a SIGKILLed one, even when their
    Redis is already gone (a cold shutdown would wait for it): kill the training groups below us,
    then our own group."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    me = psutil.Process()
    for child in me.children(recursive=True):
        try:
            pgid = os.getpgid(child.pid)
        except ProcessLookupError:
            continue
        if pgid != os.getpgid(0):
            kill_group(pgid, grace_s=2.0)
    os.killpg(os.getpgid(0), signal.SIGKILL)


@signals.worker_ready.connect
def start_sweeping(sender=None, **_: object) -> None:
    """Started after the pool forked its children, so no child inherits a thread's held lock."""
    if sender is None or CONTROL_QUEUE not in sender.app.amqp.queues.consume_from:
        return
    from scheduler.cluster.control_loop import sweep_forever

    from tasks.work import CeleryWork

    threading.Thread(target=sweep_forever, args=(redis_client(sender.app.conf), CeleryWork(sender.app), _stop_sweeping),
                     daemon=True, name="control sweep").start()


@signals.worker_shutdown.connect
def unregister(**_: object) -> None:
    _stop_sweeping.set()
    while _heartbeats:
        _heartbeats.pop().stop()


@signals.worker_process_shutdown.connect
def stop_warm_interpreter(**_: object) -> None:
    """In a pool process on its way out (warm or cold shutdown, or recycled): its warm interpreter
    ends now, not after billiard's exit pause and a teardown of torch, so it never outlives the
    worker (`deploy down` and the tests' checks for leftovers look right after it)."""
    WARM.stop()


@signals.task_revoked.connect
def kill_revoked_rank(request=None, **_: object) -> None:
    """Backup for revoke(terminate=True): the pool child's own cleanup may be cut short."""
    if request is not None:
        _kill_recorded_group(request.id)


@signals.task_failure.connect
def kill_timed_out_rank(task_id: str | None = None, exception: BaseException | None = None,
                        **_: object) -> None:
    """A hard time limit SIGKILLs the pool child 0.1 s after SIGTERM: finish its job from here."""
    if task_id and isinstance(exception, TimeLimitExceeded):
        _kill_recorded_group(task_id)


def _kill_recorded_group(task_id: str) -> None:
    """Kill the training group a rank task recorded, without blocking the worker's main loop."""
    slot_json = os.environ.get("AUTOTUNE_SLOT_JSON")
    if not slot_json:
        return
    from tasks.app import app

    queue = Slot.from_redis(json.loads(slot_json)).queue
    pgid = redis_client(app.conf).get(keys.pgid(queue, task_id))
    if pgid and group_runs_slot(int(pgid), queue):
        threading.Thread(target=kill_group, args=(int(pgid),), daemon=True).start()


def kill_orphans(client: redis.Redis, queue: str) -> int:
    """Kill training groups left by an earlier worker of this slot (one that was SIGKILLed): those its
    records name that are still those ranks (`workers.process.process_identity.leftover_groups`)."""
    groups = leftover_groups(client, queue)
    for pgid in groups:
        kill_group(pgid)
    return len(groups)


def _redis_host_port(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 6379
