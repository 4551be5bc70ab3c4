"""Not collected by the suite: test_killed_run.py runs this file as a pytest run of its own and kills
that run with SIGKILL once the cluster below is up. It starts what the suite's tests start (the
session's redis-server and hand-started Celery workers, a process in a session of its own, as a rank
is) and writes their pids to KILLED_RUN_READY, then waits to be killed."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def test_hold_a_cluster_until_killed(hand_cluster):
    loner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    Path(os.environ["KILLED_RUN_READY"]).write_text(json.dumps(
        {"token": os.environ["AUTOTUNE_TEST_RUN"], "loner": loner.pid}))
    time.sleep(3600)
