"""Every Celery worker this project starts gets its flags from `scheduler.embedded.worker_command`: the embedded
cluster and `python -m deploy` call it, and the systemd units and the Slurm script, which are text,
carry exactly its command lines (given the placeholders each template uses)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from deploy import remote
from deploy.plan import plan_workers, up_request
from deploy.templates import FOLDER
from scheduler.embedded import local_cluster
from scheduler.embedded.worker_command import (CONTROL_QUEUE, control_worker_argv, flower_argv, slot_worker_argv,
                                    worker_argv)

#: Each template's Celery command lines, in order, as the builder writes them with its placeholders.
TEMPLATE_COMMANDS = {
    "celery-autotune-slot@.service": [slot_worker_argv("%i", "%H", "{{python}}")],
    "celery-autotune-control.service": [control_worker_argv("%H", "{{python}}")],
    "autotune.sbatch": [slot_worker_argv("$i", "$(hostname -s)", "$1"),
                        control_worker_argv("$(hostname -s)", "$python")],
}
_COMMAND_ENDS = {"&", ">", "2>&1", ";", "|", "&&"}


def celery_commands(text: str) -> list[list[str]]:
    """The argv of every `-m celery` line of a template: continuations joined, `ExecStart=` and the
    shell's redirections and `&` left off, words as the shell (or systemd, for these words) splits them."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        if "-m celery" not in line or line.lstrip().startswith("#"):
            continue
        words = shlex.split(line.split("ExecStart=", 1)[-1])
        end = next((i for i, word in enumerate(words) if word in _COMMAND_ENDS), len(words))
        commands.append(words[:end])
    return commands


@pytest.mark.parametrize("template", sorted(TEMPLATE_COMMANDS))
def test_each_template_runs_the_builders_command_lines(template: str) -> None:
    assert celery_commands((FOLDER / template).read_text()) == TEMPLATE_COMMANDS[template]


def test_the_template_check_sees_a_flag_missing() -> None:
    text = (FOLDER / "autotune.sbatch").read_text()
    planted = text.replace("--without-gossip ", "", 1)
    assert planted != text and celery_commands(planted) != TEMPLATE_COMMANDS["autotune.sbatch"]


def test_slot_and_control_workers_flags() -> None:
    assert slot_worker_argv(3, "n1", "py") == ["py", "-m", "celery", "-A", "tasks", "worker", "-Q", "gpu3",
                                               "-n", "gpu3@n1", "-c", "1", "--without-gossip",
                                               "--without-mingle", "-l", "INFO"]
    assert control_worker_argv("n1", "py")[6:12] == ["-Q", CONTROL_QUEUE, "-n", "control@n1", "-c", "2"]
    assert worker_argv("gpu0", "gpu0@x")[0] == sys.executable and "-c" not in worker_argv("gpu0", "gpu0@x")
    assert flower_argv(5555, "py") == ["py", "-m", "celery", "-A", "tasks", "flower", "--address=127.0.0.1",
                                       "--port=5555"]


def test_the_embedded_cluster_starts_the_builders_workers(tmp_path: Path) -> None:
    cluster = local_cluster.LocalCluster(2, tmp_path, node="n1", devices=[0, 3])
    assert cluster.worker_commands() == [("gpu0", slot_worker_argv(0, "n1")), ("gpu3", slot_worker_argv(3, "n1")),
                                         (CONTROL_QUEUE, control_worker_argv("n1"))]


def test_deploy_starts_the_builders_workers(tmp_path: Path, monkeypatch) -> None:
    """What `deploy.remote up` runs for each planned worker is the builder's command for it."""
    started = []

    class Started:
        pid = 1

    monkeypatch.setattr(remote.subprocess, "Popen", lambda argv, **kwargs: started.append(argv) or Started())
    monkeypatch.setattr(remote.psutil, "Process", lambda pid: type("P", (), {"create_time": lambda self: 0.0})())
    request = up_request(plan_workers({"n1": [0, 2]}, control_host="n1", flower=True), {}, flower_port=5555)
    remote.up(tmp_path, request)
    assert started == [slot_worker_argv(0, "n1"), slot_worker_argv(2, "n1"), control_worker_argv("n1"),
                       flower_argv(5555)]
