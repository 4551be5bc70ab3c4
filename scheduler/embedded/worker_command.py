"""The command line of every Celery process this project starts: a slot worker, the control worker, Flower.

Why one module: a worker started by the embedded cluster (`scheduler.embedded.local_cluster`), by `python -m
deploy` (`deploy.remote`), by a systemd unit or by the Slurm script (deploy/templates/) must behave
alike, so each takes its flags from here. The templates are shell and unit text, written out in
full for an operator to read; tests/unit/test_worker_command.py checks their command lines against
these functions, given the placeholders the templates use (`%i`, `%H`, `$i`, `$(hostname -s)`).

The flags, and why:
- `-Q`: a slot worker serves its bare `gpu<i>` (the worker makes it `<node>.gpu<i>` when it starts,
  `tasks.worker_hooks`), the control worker CONTROL_QUEUE;
- `-n`: `gpu<i>@<host>` or `control@<host>`, so a slot's node name can be read from its worker's;
- `-c`: one process for a slot worker (a slot runs one rank at a time), two for the control worker
  (several jobs' steps and callbacks at once);
- `--without-gossip --without-mingle`: the workers coordinate through Redis (`workers.state.keys`), never
  with each other, so none listens to its peers' events (Flower still receives them) or asks every
  peer for its state at start-up;
- `-l INFO`: what the logs the tool points users to need.
"""
from __future__ import annotations

import sys

#: The queue of the control worker: every job's steps, dispatch and experiment callbacks.
CONTROL_QUEUE = "control"
SLOT_PROCESSES = 1  #: `-c` of a slot worker
CONTROL_PROCESSES = 2  #: `-c` of the control worker
_CELERY = ("-m", "celery", "-A", "tasks")


def worker_argv(queue: str, name: str, concurrency: int | None = None, python: str = sys.executable) -> list[str]:
    """One Celery worker of this project: serving `queue` as `name` with `concurrency` processes
    (Celery's default, one per core, when None), run by the interpreter `python`."""
    argv = [python, *_CELERY, "worker", "-Q", queue, "-n", name]
    if concurrency is not None:
        argv += ["-c", str(concurrency)]
    return [*argv, "--without-gossip", "--without-mingle", "-l", "INFO"]


def slot_names(device: int | str, host: str) -> tuple[str, str]:
    """(queue, worker name) of the slot worker of `device` on `host`: `gpu<i>`, `gpu<i>@<host>`."""
    return f"gpu{device}", f"gpu{device}@{host}"


def control_names(host: str) -> tuple[str, str]:
    """(queue, worker name) of the control worker on `host`: CONTROL_QUEUE, `control@<host>`."""
    return CONTROL_QUEUE, f"{CONTROL_QUEUE}@{host}"


def slot_worker_argv(device: int | str, host: str, python: str = sys.executable) -> list[str]:
    """The slot worker of `device` on `host` (a device index, or a placeholder such as systemd's `%i`)."""
    return worker_argv(*slot_names(device, host), SLOT_PROCESSES, python)


def control_worker_argv(host: str, python: str = sys.executable) -> list[str]:
    """The control worker on `host`."""
    return worker_argv(*control_names(host), CONTROL_PROCESSES, python)


def flower_argv(port: int, python: str = sys.executable) -> list[str]:
    """Flower on 127.0.0.1:`port`; its basic auth comes from the environment (FLOWER_BASIC_AUTH), so
    no secret is on its command line."""
    return [python, *_CELERY, "flower", "--address=127.0.0.1", f"--port={int(port)}"]
