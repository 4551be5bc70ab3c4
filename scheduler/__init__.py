"""celery-autotune's scheduler: the commands at this level, over six packages, one concern each.

    celery-autotune --autotuning tune ...   cli.py: DeepSpeed's launcher line; tunes (autotune.py) or
                                            launches (run.py)
    python -m scheduler.autotune cfg.json   autotune.py: tune (embedded cluster when none is set);
                                            preflight.py: its input check, every refusal before a folder
    python -m scheduler.run ...             run.py: launch the tuned (or any) training like `deepspeed`
    python -m scheduler.autotune --status   status.py (+ live_view.py: a job's progress in the terminal)
    python -m scheduler.resources ...       resources.py: which hosts and devices a run would use

Packages, lowest first (each `__init__` says more; tests/unit/test_architecture.py holds the order):
- `embedded/`: the command's machine: the embedded cluster, every Celery worker's command line;
- `inputs/`: what the user gives (config file, arguments, results folder);
- `search/` (pure): the space, the memory model, DeepSpeed's search and ours, tuners, ranking;
- `launch/` (pure but for reading a hostfile): DeepSpeed's runner: hostfile, include/exclude,
  launchers, environment, elastic batch sizes;
- `report/`: what a run leaves in its results folder: records, summary, optimal config, plots;
- `cluster/`: the control path in Redis: jobs, their queues and steps, dispatch onto slots.
`errors.py` is the error vocabulary every layer raises; `exits.py` how a command ends on one.
`workers/` (the slots), `deploy/` (SSH) and `tasks/` (the Celery app) sit beside this package: see
ARCHITECTURE.md.

Imports: every package below, `tasks` (the commands send work to the cluster), `deploy`, `workers`.
Imported by: nothing of the project's (the commands are the top); tests and bench/.
"""
