"""The README is a front door: short, and every link in it and in docs/ opens.

Relative link targets in the README, in docs/ and in the pages they link to must exist in
the checkout; the README stays under 250 lines and names nothing a reader cannot open (an
issue number, a file outside the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250

# [text](target) and ![alt](target), outside code blocks; a #fragment is dropped
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return [m.group(1) for m in _LINK.finditer(text)]


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_the_scan_sees_links() -> None:
    assert "docs/design.md" in _links(README)
    assert "benchmarks/results/README.md" in _links(README)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    missing = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            missing.append(target)
        elif ROOT not in path.parents and path != ROOT:
            missing.append(f"{target} (outside the repository)")
    assert not missing, f"{page.relative_to(ROOT)} links to what is not there: {missing}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t).resolve() for t in _links(README)}
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_readme_is_short_and_names_only_what_a_reader_can_open() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert not re.search(r"\bissues? #?\d+", text, flags=re.IGNORECASE)
    assert "ANCHORS" not in text and "shared/" not in text
    assert "## Several GPUs" in text


def test_help_texts_name_no_file_outside_the_repository() -> None:
    from ramflow.cli.main import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "train" in a.choices)
    texts = [parser.format_help()] + [p.format_help() for p in subparsers.choices.values()]
    for text in texts:
        assert "ANCHORS" not in text
        assert not re.search(r"\bissue \d+", text)
