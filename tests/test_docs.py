"""The docs stay true to themselves: code blocks parse, relative links and anchors resolve, and
every CLI command the docs show exists."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_parse(page):
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
        ast.parse(textwrap.dedent(block), filename=str(page))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to missing {target}"
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{page.name}: no heading for #{anchor} in {dest.name}"


def test_cli_commands_in_the_docs_exist():
    from goodput_ckpt.cli._registry import COMMAND_MODULES

    shown = set()
    for page in PAGES:
        for block in re.findall(r"```(?:sh|console)\n(.*?)```", page.read_text(), flags=re.S):
            shown |= set(re.findall(r"goodput-ckpt ([a-z]+)", block))
    assert shown, "the docs lost their command examples"
    assert shown <= set(COMMAND_MODULES), shown - set(COMMAND_MODULES)


def test_architecture_names_modules_that_exist():
    """docs/architecture.md reads the save and the restore through module paths
    (`manager/save_job.py`, `manager/staging/`): each must exist, so the page cannot drift from
    the code unnoticed when a module moves."""
    page = ROOT / "docs" / "architecture.md"
    package = ROOT / "goodput_ckpt"
    named = set(re.findall(r"`([a-z_]+/(?:[a-z_]+/)*(?:[a-z_]+\.py)?)`", page.read_text()))
    assert len(named) > 20, named
    missing = sorted(p for p in named if not (package / p).exists() and not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
