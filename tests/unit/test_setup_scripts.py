"""The README's two quick-start commands each set up only what they run, and CI runs the second.

Command 1 (tune) sets up with deploy/setup.sh, command 2 (test) with deploy/setup_tests.sh, which
adds what only the tests use; `.ci/run` is command 2 word for word. A test-only package that moves
into setup.sh would make a failed chromium install stop a user's first tuning run.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST_ONLY_APT = ("openssh-server", "iproute2", "util-linux", "chromium")


def quick_start(text: str) -> dict[str, str]:
    """The quick-start block's commands by their number: the line after each `# N.` comment."""
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands, number = {}, None
    for line in block.splitlines():
        found = re.match(r"#\s*(\d+)\.", line.strip())
        if found:
            number = found.group(1)
        elif line.strip() and number:
            commands[number], number = line.strip(), None
    return commands


def code(path: Path) -> str:
    """The script without its comments and blank lines."""
    lines = (line.split(" #", 1)[0].rstrip() for line in path.read_text().splitlines())
    return "\n".join(line for line in lines if line and not line.lstrip().startswith("#"))


def test_ci_runs_exactly_the_readme_test_command() -> None:
    commands = quick_start((ROOT / "README.md").read_text())
    ci = code(ROOT / ".ci" / "run").splitlines()
    assert ci[-1] == commands["2"], (ci[-1], commands["2"])


def test_each_quick_start_command_sets_up_with_its_own_script() -> None:
    commands = quick_start((ROOT / "README.md").read_text())
    assert commands["1"].startswith("bash deploy/setup.sh && ") and "pytest" not in commands["1"]
    assert commands["2"].startswith("bash deploy/setup_tests.sh && ")


def test_the_tuning_setup_installs_nothing_only_the_tests_use() -> None:
    setup = code(ROOT / "deploy" / "setup.sh")
    assert [name for name in TEST_ONLY_APT if name in setup] == []
    assert re.search(r"^extras=(\S+)$", setup, flags=re.MULTILINE).group(1) == "deepspeed"
    tests_setup = code(ROOT / "deploy" / "setup_tests.sh")
    assert all(name in tests_setup for name in TEST_ONLY_APT)
    assert "bash deploy/setup.sh --extras deepspeed,dev,hf" in tests_setup


@pytest.mark.parametrize("script", ["deploy/setup.sh", "deploy/setup_tests.sh", "deploy/apt_install.sh", ".ci/run"])
def test_each_setup_script_parses(script: str) -> None:
    proc = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_setup_refuses_an_unknown_argument() -> None:
    proc = subprocess.run(["bash", str(ROOT / "deploy" / "setup.sh"), "--tests"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "usage:" in proc.stderr
