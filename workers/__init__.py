"""Runs on a slot: device binding, slot registration, launching the user's script, classifying how it ended.

This is the lowest layer: it imports nothing from `tasks/`, `scheduler/` or `deploy/`, so a slot
worker on a remote node needs only this package and the Celery app (tests/unit/test_architecture.py).

Two kinds of module live here, and the difference matters:

| runs in | modules | so |
|---|---|---|
| the user's training process (imported into someone else's program) | `entry` (the wrapper every rank's script runs under), `step_clock`, `device_memory`, `oom`, `op_build`, `failure`, `metrics` (for scripts that do not use DeepSpeed) | light: the standard library and torch only, never Celery or Redis (tests/unit/test_architecture.py checks) |
| the slot worker (a Celery worker bound to one device) | `slot`, `gpus`, `cuda_binding`, `topology`, `registry`, `rank` (the `run_rank` task's stages), `rank_spec` (what a rank is given), `rank_peers` (its flags and checks shared with its launch's other ranks), `rank_record` (its record), `launch`, `tree_memory` (what `launch` holds against the memory cap, read cheaply), `rendezvous`, `gang`, `keys`, `records`, `timeline`, `metric_check`, `build_locks`, `op_prebuild`, `device_idle`, `slot_health`, `shared_memory`, `paths`, `layout` (what the tool writes into a results folder; the overwrite guard reads it too), `redis_tls`, `redis_url` (the one check of the cluster's Redis URL, and its masking), `warm_start`, `rank_start` (how a rank was started, warm or cold, and why), `warm_plan` (what it preloads, which scripts run cold: pure), `warm_server` (the forkserver `warm_start` drives), `process_identity` (what a training process is: its title and the slot's record of it, never its environment) | may use Redis and psutil; `op_prebuild` also runs as a child interpreter (`python -m workers.op_prebuild`) |
| the slot's warm interpreter (a forkserver that forks ranks, `workers.warm_start`) | `warm_preload` (its preload), `warm_rank` (what a forked process does to become the rank before `entry` runs the script) | the standard library and torch only: the ranks it forks carry what it imported |
| the command's machine | `local_cluster` (the embedded cluster: its redis-server and workers), `worker_command` (every Celery worker's command line: the embedded cluster's, `deploy`'s, the templates') | used by `python -m scheduler.autotune` and the tests |
"""
