"""The documentation stays true to the code: the configuration reference is the schema's, the layout the modules',
and every relative link
between README.md and docs/ reaches an existing file (and heading, where it names one)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


@pytest.mark.parametrize("generator", ["config_reference.py", "layout.py"])
def test_generated_pages_are_current(generator):
    """docs/configuration.md is the schema's and docs/layout.md the modules' docstrings, regenerated on change."""
    checked = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "dev" / generator), "--check"], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def anchors(page) -> set[str]:
    """The heading anchors GitHub gives a markdown page (lowercase, punctuation dropped, spaces as hyphens)."""
    headings = re.findall(r"^#+\s+(.*)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)
