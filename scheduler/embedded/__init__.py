"""The command's machine: the embedded cluster and the command line of every Celery worker.

`local_cluster` is the cluster `python -m scheduler.autotune` and `scheduler.run` start when none
is set: its redis-server, its slot workers and control worker, and its clean stop;
`worker_command` builds every Celery worker's command line (the embedded cluster's, `deploy`'s,
the systemd units' and the Slurm script's), and names the control worker's queue.

Imports: the standard library, redis and `workers` (the slots' state and processes it starts and
reads); nothing else of the project.
Imported by: the commands (`scheduler.autotune`, `scheduler.run`, `scheduler.preflight`), `deploy`,
the Celery app's settings and tasks (the control queue's name), bench/ and the tests.
"""
