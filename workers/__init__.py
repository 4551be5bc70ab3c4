"""Runs on a slot: device binding, slot registration, launching the user's script, classifying how it ended.

This is the lowest layer: it imports nothing from `tasks/`, `scheduler/` or `deploy/`, so a slot
worker on a remote node needs only this package and the Celery app (tests/unit/test_architecture.py).

Its modules live in subpackages, one concern each, lowest first; each `__init__` says what it may
import, and tests/unit/test_architecture.py holds the order (`LAYERS`):

| subpackage | runs in | modules | may import |
|---|---|---|---|
| `in_rank` | the user's training process (imported into someone else's program) | `entry` (the wrapper every rank's script runs under), `step_clock`, `device_memory`, `oom`, `op_build`, `failure`, `metrics` (for scripts that do not use DeepSpeed) | the standard library and torch only, never Celery, Redis or psutil |
| `files` | every process that writes a folder | `paths` (atomic JSON, safe joins), `layout` (what the tool writes into a results folder; the overwrite guard reads it too) | the standard library |
| `device` | the slot worker | `slot` (the `Slot`: a device, its capacity, its child's binding), `gpus`, `topology`, `cuda_binding`, `device_idle` | the standard library |
| `state` | the slot worker, the control worker, the command | `keys` (every Redis key), `redis_tls`, `redis_url` (the one check of the cluster's Redis URL, and its masking), `registry`, `gang`, `rendezvous`, `slot_view`, `slot_health`, `rank_groups` (the training group each rank started), `store` (the slots' store) and `memory_store` (its in-memory twin) | redis, `device` |
| `process` | the slot worker | `launch`, `launch_files`, `tree_memory` (what `launch` holds against the memory cap, read cheaply), `process_identity` (what a training process is: its title and the slot's record of it, never its environment), `shared_memory` | psutil, redis, `in_rank`, `files`, `state` |
| `warm` | the slot worker; its warm interpreter (a forkserver) and the ranks it forks | `warm_start` (drives the forkserver), `warm_plan` (what it preloads, which scripts run cold: pure), `warm_server` (the forkserver), `warm_preload` (its preload), `warm_rank` (what a forked process does to become the rank before `entry` runs the script), `rank_start` (how a rank was started, warm or cold, and why) | `warm_preload` and `warm_rank`: the standard library, torch and `in_rank` only (the ranks carry what they import); the others also `process` |
| `slot` | the slot worker (a Celery worker bound to one device) | `rank` (the `run_rank` task's stages), `rank_spec` (what a rank is given), `rank_peers` (its flags and checks shared with its launch's other ranks), `rank_claim`, `rank_record` (its record), `records` (an experiment's record: pure), `timeline`, `metric_check`, `build_locks`, `op_prebuild` (also a child interpreter: `python -m workers.slot.op_prebuild`), `consumer_watch` | every subpackage above |

The command's machine (the embedded cluster and every Celery worker's command line) is
`scheduler.embedded`, above this package.
"""
