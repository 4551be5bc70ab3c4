"""Flower as the cluster's view: started by the embedded cluster on request, bound to 127.0.0.1 with
generated basic auth, showing the slot workers and readable experiment tasks after a real run; and
the Redis password nowhere: not in Celery's conf as workers report it, not in Flower's pages or API,
not in any log, result file or stored task result, not on any command line.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest
import redis

from integration_helpers import run_autotune, wait_for, write_config
from scheduler.embedded.local_cluster import LocalCluster, free_tcp_port

pytestmark = pytest.mark.integration


def get(port: int, path: str, auth: str | None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=20) as answer:
            return answer.status, answer.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def healthy(port: int) -> bool:
    """Flower answers its health check; refused while it is still starting (the cluster does not wait)."""
    try:
        return get(port, "/healthcheck", None)[0] == 200
    except urllib.error.URLError:
        return False


def test_flower_shows_slots_and_experiments_and_no_password_leaks(tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("chromium is required (deploy/setup_tests.sh installs it)")
    port = free_tcp_port()
    with LocalCluster(2, tmp_path / "cluster", slot_memory="1GiB", node="flowernode",
                      flower_port=port) as cluster:
        password = urlparse(cluster.url).password
        auth = cluster.flower_auth
        wait_for(lambda: healthy(port), 60, "flower")
        listening = [c for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
                     and c.status == psutil.CONN_LISTEN]
        assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening), "Flower binds loopback only"
        assert get(port, "/api/workers", None)[0] == 401 and get(port, "/", None)[0] == 401
        assert get(port, "/api/workers", "autotune:wrong")[0] == 401

        cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2])
        done = run_autotune([str(cfg), "--num_gpus", "1", "--exp-timeout", "60"], cwd=tmp_path,
                            env_extra={"AUTOTUNE_REDIS_URL": cluster.url})
        assert done.returncode == 0, done.stderr[-2000:]

        status, workers = get(port, "/api/workers?refresh=1", auth)
        assert status == 200
        assert {"gpu0@flowernode", "gpu1@flowernode", "control@flowernode"} <= set(json.loads(workers))
        wait_for(lambda: len([t for t in json.loads(get(port, "/api/tasks", auth)[1]).values()
                              if t["name"] == "autotune.run_rank"]) >= 2, 30, "rank tasks in Flower")
        tasks = json.loads(get(port, "/api/tasks", auth)[1])
        ranks = [t for t in tasks.values() if t["name"] == "autotune.run_rank"]
        assert all(t["args"].startswith("(experiment=") and "rank=0" in t["args"]
                   and "slot='flowernode.gpu" in t["args"] for t in ranks), ranks[0]["args"]
        shown = json.dumps(tasks)
        assert "gang_token" not in shown and "fake_train.py" not in shown

        page = tmp_path / "workers.png"
        browse = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,900",
                  "--virtual-time-budget=8000",
                  f"--user-data-dir={tmp_path / 'chromium'}"]
        dom = subprocess.run([*browse, "--dump-dom", f"http://{auth}@127.0.0.1:{port}/"],
                             capture_output=True, text=True, timeout=90)
        assert "gpu0@flowernode" in dom.stdout and "gpu1@flowernode" in dom.stdout, dom.stdout[-1500:]
        subprocess.run([*browse, f"--screenshot={page}", f"http://{auth}@127.0.0.1:{port}/"],
                       capture_output=True, timeout=90)
        assert page.stat().st_size > 10_000
        shutil.copy(page, Path(os.environ.get("AUTOTUNE_SCREENSHOT_DIR", tmp_path)) / "flower-workers.png")

        # The password, nowhere: worker conf (what `celery inspect conf` prints), Flower, Redis
        # results, files on disk, command lines.
        from celery import Celery

        app = Celery("probe", broker=cluster.url, backend=cluster.url)
        confs = app.control.inspect(timeout=5).conf() or {}
        assert {"gpu0@flowernode", "control@flowernode"} <= set(confs)
        texts = {"inspect conf": json.dumps(confs), "flower workers": workers, "flower tasks": shown,
                 "flower page": dom.stdout}
        for path in ("/", "/tasks", "/worker/gpu0@flowernode", "/broker"):
            texts[f"flower {path}"] = get(port, path, auth)[1]
        client = redis.Redis.from_url(cluster.url)
        for key in client.scan_iter(match="celery-task-meta-*"):
            texts[key.decode()] = (client.get(key) or b"").decode(errors="replace")
        for file in tmp_path.rglob("*"):
            if file.is_file() and file.suffix not in (".png",) and "chromium" not in file.parts:
                texts[str(file)] = file.read_text(errors="replace")
        texts["stdout"] = done.stdout + done.stderr
        for proc in psutil.process_iter(["cmdline"]):
            texts[f"pid {proc.pid}"] = " ".join(proc.info["cmdline"] or [])
        leaks = [where for where, text in texts.items() if password in text]
        assert not leaks, f"the Redis password appears in: {leaks}"
