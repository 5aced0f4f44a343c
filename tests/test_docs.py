"""The user-facing pages: README short, its figures docs/benchmarks.md's own, every link and anchor alive."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces as hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a heading met again gets -1, -2... as on GitHub."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    found: set[str] = set()
    for line in text.splitlines():
        if re.match(r"#{1,6} ", line):
            name = base = anchor(line.lstrip("#"))
            count = 0
            while name in found:
                count += 1
                name = f"{base}-{count}"
            found.add(name)
    return found


def test_the_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_the_readme_states_only_figures_copied_from_the_benchmarks_page() -> None:
    """Every table row of the README with a figure in it is one of docs/benchmarks.md's, so the two cannot
    disagree."""
    rows = [
        line for line in README.read_text().splitlines() if line.startswith("|") and re.search(r"\d", line)
    ]
    assert rows, "the README has no table of results"
    benchmarks = BENCHMARKS.read_text().splitlines()
    assert [row for row in rows if row not in benchmarks] == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_links_between_pages_lead_somewhere(page: Path) -> None:
    broken = []
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # another site
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(target)
    assert broken == []
