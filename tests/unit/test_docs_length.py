"""The reference pages a newcomer reads end to end stay short enough to be read end to end.

Why a test: a page that explains by adding one more clause to every rule grows a sentence at a
time until nobody reads it. Two pages are held to a word budget, a few minutes' reading each:
docs/config.md's "The search" section (what is measured, in which order, why, naming the winner;
up to the next `## ` heading) within 530 words, and docs/gpus.md within 1,025 words. A page over
budget fails here with its count; make room by saying a thing once, in fewer words, or by pointing
to the module whose docstring holds the detail.

Words are counted as `wc -w` counts them: runs of characters between whitespace.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG_PAGE = ROOT / "docs" / "config.md"
GPUS_PAGE = ROOT / "docs" / "gpus.md"
#: docs/config.md's search section, in words.
SEARCH_SECTION_WORDS = 530
#: docs/gpus.md, the whole page, in words.
GPUS_PAGE_WORDS = 1025


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section of a Markdown page: its lines up to the next `## `
    heading (its `###` subsections included). Raises KeyError when the page has no such heading."""
    lines = text.splitlines()
    try:
        start = lines.index(f"## {heading}") + 1
    except ValueError:
        raise KeyError(heading) from None
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end])


def words(text: str) -> int:
    return len(text.split())


def test_section_stops_at_the_next_heading_and_keeps_subsections() -> None:
    page = "# T\n\n## A\none two\n### A1\nthree\n## B\nfour five six\n"
    assert words(section(page, "A")) == 5  # "one two", "### A1", "three"
    assert words(section(page, "B")) == 3


def test_the_search_section_is_within_its_budget() -> None:
    count = words(section(CONFIG_PAGE.read_text(), "The search"))
    assert count > 200, "the section was not found whole"  # the reading works
    assert count <= SEARCH_SECTION_WORDS, (
        f"docs/config.md's \"The search\" has {count} words, over {SEARCH_SECTION_WORDS}")


def test_the_gpus_page_is_within_its_budget() -> None:
    count = words(GPUS_PAGE.read_text())
    assert count <= GPUS_PAGE_WORDS, f"docs/gpus.md has {count} words, over {GPUS_PAGE_WORDS}"
