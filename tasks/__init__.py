"""The Celery app (`celery -A tasks worker -Q gpu0`) and the thin task shells.

Slot workers consume `<node>.gpu<i>` (a bare `-Q gpu<i>` is rewritten to this node's queue when
the worker starts); the control worker consumes `control`. Decision logic lives in `scheduler/`,
what runs on a slot lives in `workers/`; the tasks here only carry messages between them.
"""
from tasks.app import app  # noqa: F401  (`celery -A tasks` looks for it here)
from tasks import experiment, worker_hooks  # noqa: E402,F401  (register tasks and signal handlers)
