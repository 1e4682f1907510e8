"""README.md and docs/: every relative link resolves to a file of the repository (and an anchor to a heading),
so moving a document or renaming a section cannot leave a reader at a dead link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors: a heading lower-cased, punctuation but '-' and '_' dropped, spaces as '-'."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document: Path) -> None:
    broken = []
    for target in relative_links(document):
        file, _, anchor = target.partition("#")
        resolved = (document.parent / file).resolve() if file else document
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(target)
    assert broken == [], f"{document.relative_to(ROOT)}: {broken}"


def test_the_readme_links_every_document_and_stays_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    for doc in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{doc.name})" in readme, doc.name
    assert len(readme.splitlines()) <= 210


def test_the_check_finds_a_dead_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](page.md#title) [gone](missing.md) [no heading](page.md#nowhere)\n")
    found = [t for t in relative_links(page) if not (tmp_path / t.partition("#")[0]).exists()]
    assert found == ["missing.md"]
    assert "nowhere" not in anchors(page) and "title" in anchors(page)
