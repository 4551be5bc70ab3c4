"""bench/README.md names every runnable bench with the command that runs it, in under 400 lines.

Why: the README is where a bench's current figure, its command and its date live (STYLE.md 14). A
bench added without a section leaves its figures nowhere, and a README that grows back into a
notebook of every run hides the current figure among old ones. Runnable benches are the shell
scripts in bench/ and the Python files there with a `__main__` guard; the modules the benches import
(synthetic surfaces, DeepSpeed's replay, the chaos soak's checks) are not benches.
"""
from __future__ import annotations

import re
from pathlib import Path

from test_no_history_words import history_hits

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
README = BENCH / "README.md"
MAX_LINES = 400
_MAIN_GUARD = re.compile(r"^if __name__ == ['\"]__main__['\"]\s*:", re.MULTILINE)


def runnable_benches(folder: Path = BENCH) -> list[str]:
    """The file names of the scripts in `folder` meant to be run: every .sh, and every .py with a main guard."""
    names = [p.name for p in folder.glob("*.sh")]
    names += [p.name for p in folder.glob("*.py") if _MAIN_GUARD.search(p.read_text(encoding="utf-8"))]
    return sorted(names)


def command_lines(markdown: str) -> list[str]:
    """The lines of `markdown`'s code: fenced blocks, and indented blocks (4 spaces after a blank line or
    after another code line; an indented line that continues a paragraph or a list item is not code)."""
    lines, fenced, in_code, previous_blank = [], False, False, True
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced, in_code, previous_blank = not fenced, False, False
            continue
        blank = not line.strip()
        in_code = fenced or (not blank and line.startswith("    ") and (previous_blank or in_code))
        if in_code:
            lines.append(line.strip())
        previous_blank = blank
    return lines


def commands_naming(name: str, lines: list[str]) -> list[str]:
    """The command lines that run bench/`name` (the path as a word of its own, not a longer file's part)."""
    word = re.compile(rf"(?<![\w/.-])bench/{re.escape(name)}(?![\w.-])")
    return [line for line in lines if word.search(line)]


def test_runnable_benches_are_told_from_the_modules_they_import() -> None:
    names = runnable_benches()
    assert any(n.endswith(".py") for n in names) and any(n.endswith(".sh") for n in names), names
    assert "surfaces.py" not in names and "deepspeed_replay.py" not in names, names


def test_command_lines_are_the_code_blocks_only() -> None:
    text = ("Run `bench/a.py` like this:\n\n    .venv/bin/python bench/a.py --x 1\n\n"
            "```\nbash bench/b.sh\n```\n- a list item\n    continued bench/c.py\n")
    lines = command_lines(text)
    assert commands_naming("a.py", lines) == [".venv/bin/python bench/a.py --x 1"]
    assert commands_naming("b.sh", lines) == ["bash bench/b.sh"]
    assert commands_naming("c.py", lines) == []
    assert commands_naming("a.py", ["bench/a.py.bak", "bench/aa.py", "xbench/a.py"]) == []


def test_every_runnable_bench_has_a_command_line_in_the_readme() -> None:
    lines = command_lines(README.read_text(encoding="utf-8"))
    missing = [name for name in runnable_benches() if not commands_naming(name, lines)]
    assert not missing, f"bench/README.md gives no command line for: {', '.join(missing)}"


def test_the_readme_holds_current_figures_not_a_notebook() -> None:
    text = README.read_text(encoding="utf-8")
    count = len(text.splitlines())
    assert count < MAX_LINES, f"bench/README.md has {count} lines (under {MAX_LINES}: current figures only)"
    hits = [f"line {line}: {kind}: {phrase!r}" for line, kind, phrase in history_hits(text)]
    assert not hits, "history in bench/README.md (git log keeps it):\n" + "\n".join(hits)
