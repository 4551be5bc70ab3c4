"""The README and docs/ stay true to the code where a test can tell.

- Every `AUTOTUNE_*` environment variable the code names is in docs/environment.md's tables: a
  variable added to the code without a line there fails here. The code names a variable as a
  string literal (`os.environ.get("AUTOTUNE_X")`, or a constant `X_ENV = "AUTOTUNE_X"` read later),
  so every literal that is exactly such a name counts.
- Every command the README shows (`python -m scheduler.autotune`, `python -m scheduler.run`,
  `python -m deploy ...`, `celery -A tasks worker ...`) parses with the arguments shown: the
  project's own through their argparse parsers, Celery's worker through `celery ... --help`, which
  parses every option shown before it prints the help.
- The README stays under 200 lines, and every relative link in the README and docs/ names a file
  that exists.
"""
from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.__main__ import build_parser as deploy_parser
from scheduler import autotune
from scheduler.errors import UsageError
from scheduler.cli import build_parser as cli_parser
from scheduler.run import build_parser as run_parser

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("scheduler", "workers", "tasks", "deploy", "celeryconfig.py")
VARIABLE = re.compile(r"AUTOTUNE_[A-Z0-9_]+")
README = ROOT / "README.md"
ENVIRONMENT_PAGE = ROOT / "docs" / "environment.md"
COMMAND = re.compile(r"(?:\S*/)?(?P<tool>python -m (?:scheduler\.autotune|scheduler\.run|deploy)(?=\s|$)"
                     r"|celery-autotune(?=\s|$)"
                     r"|celery -A tasks worker(?=\s|$))")


def variables_in_code() -> dict[str, str]:
    """Every AUTOTUNE_* name held as a string in the code -> the first file holding it."""
    found: dict[str, str] = {}
    for source in SOURCES:
        root = ROOT / source
        for path in [root] if root.suffix == ".py" else sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and VARIABLE.fullmatch(node.value):
                    found.setdefault(node.value, str(path.relative_to(ROOT)))
    return found


def variables_in_tables(text: str) -> set[str]:
    """The variables a page's tables document: the first cell of each row, `AUTOTUNE_X`."""
    return set(re.findall(r"^\| `(AUTOTUNE_[A-Z0-9_]+)` \|", text, flags=re.MULTILINE))


def test_every_variable_the_code_reads_is_in_the_environment_table() -> None:
    in_code = variables_in_code()
    documented = variables_in_tables(ENVIRONMENT_PAGE.read_text())
    assert {"AUTOTUNE_REDIS_URL", "AUTOTUNE_GPU_WAIT_S", "AUTOTUNE_SSH_CONFIG"} <= set(in_code)  # the scan works
    missing = {name: where for name, where in in_code.items() if name not in documented}
    assert not missing, f"add these to {ENVIRONMENT_PAGE.relative_to(ROOT)}'s tables: {missing}"


def test_the_table_check_sees_a_missing_row() -> None:
    text = ENVIRONMENT_PAGE.read_text()
    assert "AUTOTUNE_GPU_WAIT_S" in variables_in_tables(text)
    without = "\n".join(line for line in text.splitlines() if not line.startswith("| `AUTOTUNE_GPU_WAIT_S`"))
    assert "AUTOTUNE_GPU_WAIT_S" not in variables_in_tables(without)


def readme_commands(text: str) -> list[tuple[str, list[str]]]:
    """(tool, arguments) of every command the README shows, in code blocks and inline code alike:
    comments dropped, `a && b` chains split, placeholders refused (a command must be runnable)."""
    snippets, prose, fence = [], [], None
    for line in text.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
        elif fence is None:
            prose.append(line)
        elif fence in ("", "bash", "sh"):
            snippets.append(line)
    # inline code is a command when it has arguments; a bare `python -m deploy` names the tool
    snippets += [span for span in re.findall(r"`([^`\n]+)`", "\n".join(prose)) if not COMMAND.fullmatch(span)]
    commands = []
    for snippet in snippets:
        for line in snippet.splitlines():
            for part in re.split(r"&&|\|\||;", line):
                match = COMMAND.search(part)
                if match:
                    words = shlex.split(part[match.start():], comments=True)
                    tool_words = len(match.group("tool").split())
                    commands.append((match.group("tool"), words[tool_words:]))
    return commands


def test_the_readme_shows_each_kind_of_command() -> None:
    tools = {tool for tool, _ in readme_commands(README.read_text())}
    assert tools == {"python -m scheduler.autotune", "python -m scheduler.run", "python -m deploy",
                     "celery -A tasks worker", "celery-autotune"}, tools


def _parse_own(tool: str, argv: list[str]) -> None:
    if tool == "python -m scheduler.autotune":
        autotune.parse_args(argv)
    elif tool == "python -m scheduler.run":
        run_parser().parse_args(argv)
    elif tool == "celery-autotune":
        cli_parser().parse_args(argv)
    else:
        deploy_parser().parse_args(argv)


@pytest.mark.parametrize("tool,argv", [c for c in readme_commands(README.read_text()) if not c[0].startswith("celery -A")],
                         ids=lambda value: value if isinstance(value, str) else " ".join(value))
def test_each_readme_command_parses(tool: str, argv: list[str]) -> None:
    assert not any(word.startswith("<") for word in argv), f"a placeholder in `{tool} {' '.join(argv)}`"
    _parse_own(tool, argv)


@pytest.mark.parametrize("bad", [["--slot-memroy", "1GiB"], ["cfg.json", "--num_gpus"]])
def test_the_parse_check_refuses_a_bad_command(bad: list[str]) -> None:
    with pytest.raises(UsageError):
        _parse_own("python -m scheduler.autotune", bad)


def _celery_help(argv: list[str]) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tasks", "worker", *argv, "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_each_readme_celery_command_parses() -> None:
    shown = [argv for tool, argv in readme_commands(README.read_text()) if tool.startswith("celery -A")]
    assert shown
    for argv in shown:
        proc = _celery_help(argv)
        assert proc.returncode == 0 and "Usage:" in proc.stdout, (argv, proc.stderr[-500:])
    refused = _celery_help(["-Q", "gpu0", "--queue-name", "gpu0"])  # the check can fail
    assert refused.returncode != 0 and "No such option" in refused.stderr


def test_the_readme_is_read_in_ten_minutes() -> None:
    assert len(README.read_text().splitlines()) < 200


def test_every_relative_link_names_a_file() -> None:
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
