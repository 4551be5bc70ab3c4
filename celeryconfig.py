"""Every Celery setting of celery-autotune; each non-default one says why.

The one required input is the Redis URL, from the environment (credentials never live in files):

    AUTOTUNE_REDIS_URL   redis://[:password@]host:port/db   broker, result backend and our state
                         (required by workers: one without it refuses to start, exit status 2;
                         the placeholder below only lets clients import the app); rediss://
                         for TLS, with AUTOTUNE_REDIS_CA (and AUTOTUNE_REDIS_CERT/KEY for a client
                         certificate): workers.state.redis_tls
    AUTOTUNE_VISIBILITY_TIMEOUT   seconds; must exceed the longest experiment (default 4 h)

Experiments are long, expensive tasks that run one at a time per slot, so the defaults that suit
short web tasks are wrong here in several places.
"""
import os

from workers.state.redis_tls import TlsError, celery_options
from scheduler.embedded.worker_command import CONTROL_QUEUE

# Only `broker_url` and `result_backend` hold the URL: Celery masks their passwords in
# `inspect conf`, Flower and logs; any other module-level name would be shown in clear text.
broker_url = os.environ.get("AUTOTUNE_REDIS_URL", "redis://127.0.0.1:6379/0")
# Chords need a result backend; Redis gives native chord joins (no chord_unlock polling task).
result_backend = broker_url
# TLS (rediss://): the same verified certificates for the broker and the result backend, and the
# server's name checked against the URL's host as our own clients check it (redis_tls.celery_options). Settings
# that cannot work leave these unset here; the worker's start check and every command refuse them
# with one line (workers.state.redis_tls), never a traceback at import.
try:
    broker_use_ssl = redis_backend_use_ssl = celery_options(broker_url)
except TlsError:
    broker_use_ssl = redis_backend_use_ssl = None
broker_connection_retry_on_startup = True

# Security: JSON only. Pickle would let anyone who can write to Redis run code on every slot.
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
event_serializer = "json"

# A slot runs one experiment at a time and must not hoard a second one while busy: the scheduler
# decides placement, and a prefetched message would sit behind a long run.
worker_concurrency = 1
worker_prefetch_multiplier = 1

# Acknowledge after the experiment, so a message is not lost when a worker dies before finishing
# it; a pool child killed mid-run requeues its task instead of failing the whole chord.
task_acks_late = True
task_reject_on_worker_lost = True

# With acks_late, Redis redelivers any message still unacknowledged after the visibility timeout,
# even to a healthy worker that is still running it: the timeout must exceed the longest
# experiment. kombu only sweeps every interval x throttle seconds (default ~100 s); throttle 1
# brings a dead node's messages back within ~10 s of the timeout.
broker_transport_options = {
    "visibility_timeout": int(os.environ.get("AUTOTUNE_VISIBILITY_TIMEOUT", 4 * 3600)),
    "unacked_restore_interval": 10,
    "unacked_restore_throttle": 1,
}
# Shutdown: SIGTERM is a warm shutdown and waits for the running experiment (hours, maybe), which
# is what a planned restart of a slot wants. SIGQUIT/Ctrl-C is a cold shutdown; soft shutdown first
# gives running tasks 10 s: enough for a control worker to finish a chord callback (record an
# experiment, take the job's next step) instead of dropping it. A rank still running after that is
# cancelled and its message restored at once; its launch is then lost and retried by the sweep
# (the redelivered message sees its reservation gone and refuses to run).
worker_soft_shutdown_timeout = 10.0

result_backend_transport_options = {"retry_policy": {"timeout": 5.0}}
result_expires = 7 * 24 * 3600

# Chord callbacks, and anything not routed to a slot, go to the control worker.
task_default_queue = CONTROL_QUEUE

# Flower shows tasks only when workers send events and the client sends task-sent events.
worker_send_task_events = True
task_send_sent_event = True
task_track_started = True

# Workers run for days, but recycling a pool child every N tasks stalled the control worker for
# 2-5 s in the middle of a job (and threw away its live searches, see scheduler.search.live_search): a
# child is replaced only if it really grows past ~1 GB (slot workers run the script in a
# subprocess, so its memory never counts here).
worker_max_tasks_per_child = None
worker_max_memory_per_child = 1_000_000  # KiB
