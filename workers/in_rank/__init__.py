"""What runs inside the user's training process: imported into someone else's program.

`entry` is the wrapper every rank's script runs under (`python -m workers.in_rank.entry script.py`);
`step_clock` times its steps, `device_memory` reads its peak, `oom` and `failure` classify how it
ended, `op_build` refuses an op that cannot be built, `metrics` serves scripts that do not use DeepSpeed.

Imports: the standard library, torch, and this package only (and, when installed, `setproctitle` for
the rank's title and `hjson` for an hjson config): never Celery, Redis, psutil or another package of
the project, so a training process carries nothing it did not ask for
(tests/unit/test_architecture.py checks, transitively).
Imported by: the training process (through `entry`), the warm rank (`workers.warm`), the slot worker
and `workers.process` (to read what a rank wrote), the scheduler, the Celery tasks and tests.
"""
