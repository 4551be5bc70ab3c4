"""The deployment templates render with this installation's paths and are accepted by the tools that
run them: `systemd-analyze verify` for the units, `bash -n` for the Slurm script. A broken unit must
be rejected by the same check (so the check can fail)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.templates import TEMPLATES, defaults, render
from scheduler.errors import UsageError


def rendered(tmp_path: Path) -> dict[str, Path]:
    env_file = tmp_path / "env"
    env_file.write_text("AUTOTUNE_REDIS_URL=redis://:x@127.0.0.1:6390/0\n")
    env_file.chmod(0o600)
    values = {**defaults(), "env_file": str(env_file)}
    paths = {}
    for name, file in TEMPLATES.items():
        text = render(name, values)
        assert "{{" not in text and "redis://:x@" not in text
        paths[name] = tmp_path / file
        paths[name].write_text(text)
    return paths


def verify(*units: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True,
                          timeout=60, cwd=units[0].parent)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_units_verify_and_a_broken_one_does_not(tmp_path):
    paths = rendered(tmp_path)
    slot, control = paths["slot"], paths["control"]
    assert "-Q gpu%i -n gpu%i@%H" in slot.read_text() and "EnvironmentFile=" in slot.read_text()
    done = verify(tmp_path / "celery-autotune-slot@0.service", control)
    assert done.returncode == 0, done.stderr
    control.write_text(control.read_text().replace("KillMode=mixed", "KillMode=sometimes")
                       .replace("ExecStart=", "ExecStart=relative/python "))
    assert verify(control).returncode != 0


def test_slurm_script_parses_and_keeps_the_password_off_command_lines(tmp_path):
    script = rendered(tmp_path)["slurm"]
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "srun" in text and "-Q \"gpu$i\"" in text and "-m scheduler.autotune" in text
    assert "--requirepass" not in text, "redis-server reads its password on stdin"
    broken = tmp_path / "broken.sbatch"
    broken.write_text(text.replace('2>/dev/null || true\n}', '2>/dev/null || true\n'))
    assert subprocess.run(["bash", "-n", str(broken)], capture_output=True).returncode != 0


def test_unsafe_values_are_refused():
    with pytest.raises(UsageError, match="--repo"):
        render("slot", {**defaults(), "repo": "/srv/x\nExecStartPre=/bin/evil"})
