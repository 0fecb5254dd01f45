"""The documentation: README.md as a short front page, docs/ as the mkdocs site.

The site itself is built with ``mkdocs build --strict`` by ``make test`` (broken links
and anchors inside docs/ fail there); these tests hold what mkdocs does not see: the
README's length and its links into docs/, the nav against the files, and wording.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 400
# The project's contract: the two commands of the README, as written there.
TWO_COMMANDS = (
    "make demo    # set up, then replay 1,000,000 events through the gateway (embedded default)",
    "make test    # set up, then ruff, mypy --strict and the whole test suite against real servers",
)
# Upstream projects whose issues the pages may cite by number ("redis-py issue #2914").
UPSTREAM = frozenset(
    {
        "redis-py",
        "redis",
        "valkey",
        "postgresql",
        "asyncpg",
        "aiohttp",
        "uvloop",
        "hiredis",
        "locust",
        "gevent",
        "starlette",
        "uvicorn",
        "alembic",
        "sqlalchemy",
        "mkdocs",
        "griffe",
    }
)
ISSUE = re.compile(r"(?:(\S+)\s+)?\bissues?\s+#?\d+", re.IGNORECASE)
DOCS_LINK = re.compile(r"\]\(((?:\.\./)?docs/[^)#\s]+)(?:#([^)\s]+))?\)")


def _pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _nav_files(node: Any) -> list[str]:
    """Every file named in mkdocs.yml's nav, however deeply nested."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [name for item in node for name in _nav_files(item)]
    if isinstance(node, dict):
        return [name for value in node.values() for name in _nav_files(value)]
    return []


def _anchors(page: Path) -> set[str]:
    """The ids of a page's headings, as mkdocs (Python-Markdown's toc) and GitHub make them."""
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if match is None:
            continue
        text = re.sub(r"[`*]", "", match.group(1))
        text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
        text = re.sub(r"[^\w\s-]", "", text).strip().lower()
        anchors.add(re.sub(r"[-\s]+", "-", text))
    return anchors


def test_readme_is_a_short_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    section = README.read_text().split("\n## Two commands\n", 1)[1].split("\n## ", 1)[0]
    for command in TWO_COMMANDS:
        assert command in section.splitlines(), command


def test_no_internal_issue_numbers() -> None:
    found = []
    for page in _pages():
        for match in ISSUE.finditer(page.read_text()):
            project = (match.group(1) or "").strip("([`\"'").lower()
            if project not in UPSTREAM:
                found.append(f"{page.relative_to(ROOT)}: {match.group(0)!r}")
    assert not found, found


def test_no_private_module_named() -> None:
    """The modules behind the public import paths may move: the pages name none."""
    found = [
        f"{page.relative_to(ROOT)}: {name}"
        for page in _pages()
        for name in re.findall(r"\bdedup[./]_\w+", page.read_text())
    ]
    assert not found, found


def test_every_nav_page_exists_and_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_files(config["nav"])
    assert nav, "mkdocs.yml has no nav"
    missing = [name for name in nav if not (DOCS / name).is_file()]
    assert not missing, missing
    left_out = sorted(page.name for page in DOCS.glob("*.md") if page.name not in nav)
    assert not left_out, left_out


def test_links_into_docs_resolve() -> None:
    """Links from README.md and loadtest/README.md into docs/ name a page and a heading."""
    broken = []
    for source in (README, ROOT / "loadtest" / "README.md"):
        for target, anchor in DOCS_LINK.findall(source.read_text()):
            page = (source.parent / target).resolve()
            if not page.is_file():
                broken.append(f"{source.relative_to(ROOT)}: {target}")
            elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
                broken.append(f"{source.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, broken
