"""Comments, docstrings and pages of the product say what the code does and why, not its history.

Why a test: a reason written as a pointer ("issue 21 item 8", "the eighth session", "it used to
...") tells a reader nothing without the tracker or the project's past, and a path outside the
repository (`../shared/...`) does not exist in a clone. Each such phrase in a product file fails
here, named by file and line, so the reason gets written out where it is needed.

Product files: the Python, Markdown, shell, systemd, Slurm and JSON files under the product
packages and the examples, `celeryconfig.py`, README.md, ARCHITECTURE.md and docs/*.md (bench/
and tests/ are not the product; a test's reason is held to no issue numbers, though).
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("scheduler", "workers", "tasks", "deploy", "examples")
TOP_FILES = ("celeryconfig.py", "README.md", "ARCHITECTURE.md")
SUFFIXES = (".py", ".md", ".sh", ".service", ".sbatch", ".json")

_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
#: Each pattern: a phrase that dates or points into the project's past.
PATTERNS: dict[str, re.Pattern[str]] = {
    "issue number": re.compile(r"\b[Ii]ssue #?\d+"),
    "issue pointer": re.compile(r"\([Ii]ssue\b"),
    "session dating": re.compile(rf"\b(?:{_ORDINALS}) session\b", re.IGNORECASE),
    "path outside the repository": re.compile(r"\.\./shared/"),
    "date of a change": re.compile(r"\bsince (?:19|20)\d\d-\d\d"),
}
#: "used to" in its historical sense; after these words it says what something is for.
_USED_TO = re.compile(r"\bused to\b", re.IGNORECASE)
_PURPOSE_VERBS = {"be", "is", "are", "was", "were", "been", "being", "get", "gets", "got"}


def product_files() -> list[Path]:
    files = [ROOT / name for name in TOP_FILES if (ROOT / name).is_file()]
    files += sorted((ROOT / "docs").glob("*.md"))
    for folder in FOLDERS:
        files += sorted(p for p in (ROOT / folder).rglob("*")
                        if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts)
    return files


def history_hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, the phrase) for every history phrase in `text`."""
    hits = []
    for kind, pattern in PATTERNS.items():
        hits += [(text.count("\n", 0, m.start()) + 1, kind, m.group()) for m in pattern.finditer(text)]
    for m in _USED_TO.finditer(text):
        before = re.findall(r"[A-Za-z]+", text[max(0, m.start() - 20):m.start()])
        if not before or before[-1].lower() not in _PURPOSE_VERBS:
            hits.append((text.count("\n", 0, m.start()) + 1, "'used to' of the past", m.group()))
    return sorted(hits)


def test_history_hits_tells_the_past_from_a_purpose() -> None:
    assert history_hits("a\nSee issue 21 item 8.\nIssue #3") == [
        (2, "issue number", "issue 21"), (3, "issue number", "Issue #3")]
    assert history_hits("a bound (issue: GPU OOMs classed crashed)") == [(1, "issue pointer", "(issue")]
    assert [h[1] for h in history_hits("it used to rebuild the search")] == ["'used to' of the past"]
    assert [h[1] for h in history_hits("Used to be dicts")] == ["'used to' of the past"]
    assert history_hits("the fit is used to pick probes; it can be\nused to tell them apart") == []
    assert history_hits("--include and --exclude cannot be used together") == []
    assert [h[1] for h in history_hits("(bench, the eighth session)")] == ["session dating"]
    assert [h[1] for h in history_hits("see ../shared/research/x.md")] == ["path outside the repository"]
    assert history_hits("its own session; a session of its own") == []


def test_product_files_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in product_files()}
    assert {"README.md", "ARCHITECTURE.md", "celeryconfig.py", "scheduler/search/confirm.py",
            "deploy/setup.sh", "examples/cfg.json", "docs/cluster.md"} <= names


def test_no_history_words_in_product_files() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {kind}: {phrase!r}"
             for path in product_files()
             for line, kind, phrase in history_hits(path.read_text(encoding="utf-8", errors="replace"))]
    assert not found, "history in product comments and pages (say what and why):\n" + "\n".join(found)


def test_no_issue_numbers_in_tests() -> None:
    """A test's docstring is its reason; "issue 21 item 8" in its place says nothing without the
    tracker. (This file's own examples are the one exception.)"""
    found = [f"{path.relative_to(ROOT)}:{line}: {phrase!r}"
             for path in sorted((ROOT / "tests").rglob("*.py")) if path != Path(__file__).resolve()
             for line, kind, phrase in history_hits(path.read_text(encoding="utf-8", errors="replace"))
             if kind == "issue number"]
    assert not found, "issue numbers in tests (say why instead):\n" + "\n".join(found)
