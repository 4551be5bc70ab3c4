"""Connects as a worker's Celery app does (`tasks.app`, configured by celeryconfig from
AUTOTUNE_REDIS_URL and the TLS variables) and prints one JSON line: how kombu's broker connection and
Celery's Redis result backend each ended ("connected" or the error), and the TLS options each hands
redis-py. The test that runs it needs to bypass the workers' own start check, which refuses a
server whose name does not match before Celery connects."""
from __future__ import annotations

import json
from collections.abc import Callable

from tasks.app import app


def attempt(connect: Callable[[], object]) -> str:
    try:
        connect()
    except Exception as exc:  # noqa: BLE001 - the outcome is the answer
        return f"{type(exc).__name__}: {exc}"
    return "connected"


connection = app.connection_for_write()
print(json.dumps({
    "broker": attempt(lambda: connection.ensure_connection(max_retries=1, interval_start=0, timeout=5)),
    "backend": attempt(lambda: app.backend.client.ping()),
    "broker_options": {key: str(value) for key, value in (connection.ssl or {}).items()},
    "backend_options": {key: str(value) for key, value in app.backend.connparams.items() if key.startswith("ssl_")},
}))
