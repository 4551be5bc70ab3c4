"""TLS to Redis end to end: a TLS-only redis-server on loopback (`port 0`,
`tls-port`, client certificates required) with certificates made in the test; a control worker and
a slot worker started by hand with `rediss://` and AUTOTUNE_REDIS_CA/CERT/KEY run a real job; a CA
that did not sign the server's certificate, a missing CA file and a host name the certificate does
not hold are each refused with one `error:` line naming what to fix, exit status 2."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from integration_helpers import ROOT, SCRIPTS, processes_with_marker, run_autotune, stop_group, wait_for, write_config
from tls_pki import Pki, make_pki
from scheduler.embedded.local_cluster import free_tcp_port
from scheduler.embedded.worker_command import worker_argv
from workers.state.redis_tls import CA_ENV, CERT_ENV, KEY_ENV
from workers.state.connection import connect
from workers.state.registry import control_alive, live_slots

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A redis-server that speaks TLS only and asks every client for a certificate, from
    deploy/templates/redis-tls.conf; its own certificate names `localhost` only, so 127.0.0.1 is a
    host name it does not hold."""
    folder = tmp_path_factory.mktemp("tls")
    pki = make_pki(folder / "pki", ["localhost"])
    port, password, admin = free_tcp_port(), secrets.token_hex(8), secrets.token_hex(8)
    proc = subprocess.Popen(["redis-server", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            start_new_session=True)
    # the template, filled in as docs/cluster.md's recipe does (the server's files are named as it expects)
    template = (ROOT / "deploy" / "templates" / "redis-tls.conf").read_text()
    config = template.replace("<port>", str(port)).replace("<addresses>", "127.0.0.1").replace("<tls-dir>", str(pki.ca.parent))
    # and docs/cluster.md's users: the admin's password on the default user, the cluster user `autotune`
    proc.stdin.write(f"{config}requirepass \"{admin}\"\nuser autotune on >{password} ~* &* +@all -@dangerous\n"
                     f"dir {folder}\n".encode())
    proc.stdin.close()
    url = f"rediss://autotune:{password}@localhost:{port}/0"
    env = tls_env(pki)
    client = redis.Redis.from_url(url, ssl_ca_certs=str(pki.ca), ssl_certfile=str(pki.client_cert),
                                  ssl_keyfile=str(pki.client_key))
    wait_for(client.ping, 10, "the TLS redis-server")
    yield {"url": url, "port": port, "password": password, "pki": pki, "env": env}
    stop_group(proc)


def tls_env(pki: Pki, **changes: str) -> dict[str, str]:
    return {CA_ENV: str(pki.ca), CERT_ENV: str(pki.client_cert), KEY_ENV: str(pki.client_key), **changes}


def test_a_job_runs_over_tls_and_plain_text_is_refused_by_the_server(tls_redis, tmp_path: Path) -> None:
    marker = secrets.token_hex(8)
    env = {**os.environ, "AUTOTUNE_REDIS_URL": tls_redis["url"], **tls_redis["env"], "AUTOTUNE_NODE": "tlsnode",
           "AUTOTUNE_SLOT_MEMORY": "1GiB", "AUTOTUNE_SLOTS_PER_NODE": "1", "AUTOTUNE_TEST_MARKER": marker}
    procs = []
    try:
        for queue in ("gpu0", "control"):
            with open(tmp_path / f"{queue}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    worker_argv(queue, f"{queue}@tlsnode"),
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        with_tls = {**tls_redis["env"]}
        os.environ.update(with_tls)
        try:
            client = connect(tls_redis["url"])  # workers.state.registry's own client, through the same variables
            wait_for(lambda: len(live_slots(client)) == 1 and control_alive(client), 90, "workers to register over TLS")
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.config_set("dir", "/tmp")  # the cluster user cannot move Redis's files
        finally:
            for name in with_tls:
                os.environ.pop(name, None)
        cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2], zero_optimization={"stage": 0})
        script = tmp_path / "train.py"
        script.write_text((SCRIPTS / "fake_train.py").read_text())
        proc = run_autotune([str(cfg), "--num_gpus", "1", "--", str(script)], tmp_path,
                            {"AUTOTUNE_REDIS_URL": tls_redis["url"], **tls_redis["env"]})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results = tmp_path / "autotuning_results"
        statuses = {p.parent.name: json.loads(p.read_text())["status"] for p in results.glob("*/result.json")}
        assert statuses and set(statuses.values()) == {"ok"}, statuses
        assert tls_redis["password"] not in proc.stdout + proc.stderr
        logs = "".join((tmp_path / f"{queue}.log").read_text() for queue in ("gpu0", "control"))
        assert tls_redis["password"] not in logs
    finally:
        for proc in procs:
            stop_group(proc, signal.SIGQUIT)
        wait_for(lambda: not processes_with_marker(marker), 20, "worker processes to exit")
    plain = redis.Redis(host="127.0.0.1", port=tls_redis["port"], password=tls_redis["password"], socket_timeout=3)
    with pytest.raises(redis.ConnectionError):
        plain.ping()  # the server speaks TLS only: the password never crosses in clear


@pytest.mark.parametrize(
    ("url_host", "changes", "needle"),
    [
        ("localhost", {CA_ENV: ""}, f"{CA_ENV} is not set"),
        ("localhost", {CA_ENV: "/nonexistent/ca.crt"}, f"{CA_ENV}=/nonexistent/ca.crt: no such file"),
        ("localhost", {"other_ca": "1"}, f"did not verify against {CA_ENV}"),
        ("127.0.0.1", {}, "does not name the host in AUTOTUNE_REDIS_URL"),
        ("localhost", {KEY_ENV: ""}, f"{KEY_ENV} is not set"),
    ],
    ids=["no-ca", "missing-ca-file", "wrong-ca", "host-mismatch", "cert-without-key"],
)
def test_tls_that_cannot_work_is_one_line_and_exit_2(tls_redis, tmp_path: Path, url_host: str,
                                                     changes: dict[str, str], needle: str) -> None:
    pki = tls_redis["pki"]
    env = tls_env(pki, **{k: v for k, v in changes.items() if k != "other_ca"})
    if "other_ca" in changes:
        env[CA_ENV] = str(pki.other_ca)
    url = f"rediss://autotune:{tls_redis['password']}@{url_host}:{tls_redis['port']}/0"
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1])
    proc = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, {"AUTOTUNE_REDIS_URL": url, **env}, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert tls_redis["password"] not in proc.stderr and "Traceback" not in proc.stderr

    worker = subprocess.run([sys.executable, "-m", "celery", "-A", "tasks", "worker", "-Q", "gpu0", "-n",
                             "gpu0@refused", "--without-gossip", "--without-mingle"], cwd=ROOT,
                            env={**os.environ, "AUTOTUNE_REDIS_URL": url, **env}, capture_output=True, text=True,
                            timeout=60)
    assert worker.returncode == 2 and needle in worker.stderr, worker.stdout[-2000:] + worker.stderr[-2000:]
    assert tls_redis["password"] not in worker.stdout + worker.stderr


def test_celery_itself_refuses_a_certificate_for_another_host(tls_redis) -> None:
    """Celery's own broker and result-backend connections check the server's name as our clients do:
    the server's certificate, signed by the trusted CA, names `localhost`, and the URL says 127.0.0.1."""
    url = f"rediss://autotune:{tls_redis['password']}@127.0.0.1:{tls_redis['port']}/0"
    probe = subprocess.run([sys.executable, str(SCRIPTS / "celery_tls_probe.py")], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**os.environ, "AUTOTUNE_REDIS_URL": url, **tls_redis["env"],
                                                        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    for side in ("broker", "backend"):
        assert seen[f"{side}_options"].get("ssl_check_hostname") == "True", seen  # what redis-py 5 needs asked
        assert seen[side] != "connected" and ("hostname" in seen[side] or "IP address mismatch" in seen[side]), seen
    assert tls_redis["password"] not in probe.stdout + probe.stderr
