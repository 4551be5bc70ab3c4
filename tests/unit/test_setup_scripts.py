"""The README's two quick-start commands each set up only what they run, and CI runs the second.

Command 1 (tune) sets up with deploy/setup.sh, command 2 (test) with deploy/setup_tests.sh, which
adds what only the tests use; `.ci/run` is command 2 word for word. A test-only package that moves
into setup.sh would make a failed chromium install stop a user's first tuning run. Command 1's
set-up is also run over stubs (apt, pip, Python, nvidia-smi): it adds the venv package only when
`venv` is missing and takes torch's CPU build on a machine without nvidia-smi, saying so.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST_ONLY_APT = ("openssh-server", "iproute2", "util-linux", "chromium")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


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


#: The tools deploy/setup.sh calls that are not stubbed: the only ones on the stubbed run's PATH, so
#: a real nvidia-smi, apt-get or redis-server on this machine cannot change what it decides.
_TOOLS = ("bash", "timeout", "mktemp", "cat", "rm", "grep", "sha256sum", "cut", "tr", "sed", "sort", "comm",
          "awk", "id", "dirname", "ls", "mkdir", "touch", "chmod", "cp", "ln")

_STUBS = {
    # The machine's Python: 3.11; `venv` importable unless NO_VENV=1; the CPU index reachable.
    "py": """case "$*" in
  *"version_info >= (3, 10)"*) exit 0 ;;
  *"import ensurepip, venv"*) [ "${NO_VENV:-0}" = 0 ] ;;
  *"print("*) echo 3.11 ;;
  *urllib.request*) exit 0 ;;
  "-m venv .venv") mkdir -p .venv/bin && cp "$STUBS/venv_pip" .venv/bin/pip && cp "$STUBS/venv_python" .venv/bin/python ;;
  *) echo "unexpected python $*" >&2; exit 3 ;;
esac""",
    # The venv's pip records what it installs; its python imports what pip installed.
    "venv_pip": """echo "pip $*" >> "$LOG"
case "$*" in *torch==*) touch .venv/torch ;; *" -e "*) touch .venv/pkg .venv/bin/celery-autotune
                                                     chmod +x .venv/bin/celery-autotune ;; esac""",
    "venv_python": """case "$*" in
  "-c import torch") [ -e .venv/torch ] ;;
  *"import torch, celery, scheduler"*|*"import celery, scheduler"*) [ -e .venv/pkg ] ;;
  *find_spec*) exit 1 ;;
  *"version('torch')"*) echo 2.13.0 ;;
  *) echo "unexpected venv python $*" >&2; exit 3 ;;
esac""",
    # apt records what it installs; redis-server is on the PATH once installed.
    "apt-get": """echo "apt-get $*" >> "$LOG"
case "$*" in install*redis-server*) ln -s "$STUBS/redis-server" "$TOOLS/redis-server" ;; esac""",
    "sudo": 'exec "$@"',
    "redis-server": 'echo "Redis server v=7.0.15"',
    "nvidia-smi": "exit 0",
}


def torch_pin() -> str:
    """The torch requirement deploy/setup.sh installs (`torch==X.Y.Z`)."""
    return re.search(r'^TORCH="(torch==[^"]+)"$', code(ROOT / "deploy" / "setup.sh"), flags=re.MULTILINE).group(1)


def run_setup(tmp_path: Path, gpus: bool, venv_importable: bool) -> tuple[str, list[str]]:
    """deploy/setup.sh in a copy of the repository's set-up files, on a machine of stubs with no redis-server:
    (what it printed, the apt-get and pip lines it ran)."""
    repo, stubs, tools = tmp_path / "repo", tmp_path / "stubs", tmp_path / "bin"
    (repo / "deploy").mkdir(parents=True)
    for name in ("deploy/setup.sh", "deploy/apt_install.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, repo / name)
    stubs.mkdir()
    tools.mkdir()
    for name, body in _STUBS.items():
        (stubs / name).write_text("#!" + shutil.which("bash") + "\n" + body + "\n")
        (stubs / name).chmod(0o755)
    for name in ("apt-get", "sudo"):
        (tools / name).symlink_to(stubs / name)
    if gpus:
        (tools / "nvidia-smi").symlink_to(stubs / "nvidia-smi")
    for name in _TOOLS:
        (tools / name).symlink_to(shutil.which(name))
    log = tmp_path / "log"
    log.touch()
    env = {"PATH": str(tools), "PYTHON": str(stubs / "py"), "STUBS": str(stubs), "TOOLS": str(tools),
           "LOG": str(log), "NO_VENV": "0" if venv_importable else "1"}
    proc = subprocess.run(["bash", str(repo / "deploy" / "setup.sh")], capture_output=True, text=True, timeout=60,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr, log.read_text().splitlines()


def test_tuning_setup_without_gpus_adds_venv_and_takes_the_cpu_torch(tmp_path: Path) -> None:
    """README command 1 on a machine with no GPU and no `venv`: apt adds redis-server and the venv
    package only, torch comes from the CPU index, and setup says so."""
    out, ran = run_setup(tmp_path, gpus=False, venv_importable=False)
    apt = [line for line in ran if line.startswith("apt-get install")]
    assert apt == ["apt-get install -y -qq redis-server python3.11-venv"], ran
    torch = [line for line in ran if "torch==" in line]
    assert torch == [f"pip install -q --disable-pip-version-check --index-url {CPU_INDEX} {torch_pin()}"], ran
    assert "the CPU build" in out and "no nvidia-smi" in out
    assert "setup: ready (.venv with torch 2.13.0 and celery-autotune[deepspeed], redis-server 7.0.15)" in out


def test_tuning_setup_with_gpus_takes_pips_torch_and_no_venv_package_it_has(tmp_path: Path) -> None:
    out, ran = run_setup(tmp_path, gpus=True, venv_importable=True)
    assert [line for line in ran if line.startswith("apt-get install")] == ["apt-get install -y -qq redis-server"]
    assert [line for line in ran if "torch==" in line] == [f"pip install -q --disable-pip-version-check {torch_pin()}"]
    assert "CUDA" in out
