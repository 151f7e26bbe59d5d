"""Every relative link in README.md and docs/**/*.md points at a file of the repository (and,
with ``#anchor``, at a heading of that file): docs move (docs/lab/), and a link nobody clicks
rots silently. Links in code blocks and inline code are not links; web links are not checked."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from batchpilot.config import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    out, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: Counter[str] = Counter()
    out = set()
    fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6} (.*)$", line)
        if m:
            s = slug(m.group(1))
            out.add(s if seen[s] == 0 else f"{s}-{seen[s]}")
            seen[s] += 1
    return out


def broken_links(doc: Path) -> list[str]:
    """The relative links of ``doc`` that do not resolve, each with why."""
    bad = []
    for target in _LINK.findall(_prose(doc.read_text(encoding="utf-8"))):
        if _EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no {dest}")
        elif path and not dest.is_relative_to(REPO_ROOT.resolve()):
            bad.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_the_checker_finds_a_broken_link(tmp_path: Path) -> None:
    """The check itself can fail: a missing file, a missing heading and a link out of the
    repository are reported; code and web links are left alone."""
    page = REPO_ROOT / "docs" / "gateway.md"
    text = ("# Title\n[ok](gateway.md#start-and-stop) [self](#title) [web](https://example.com)\n"
            "[gone](nothere.md) [anchor](gateway.md#no-such-heading) [out](page.md) `[code](x.md)`\n"
            "```\n[fenced](y.md)\n```\n")
    doc = tmp_path / "page.md"
    doc.write_text(text.replace("gateway.md", str(page)))
    bad = broken_links(doc)
    assert len(bad) == 3 and "nothere.md" in bad[0] and "#no-such-heading" in bad[1], bad
    assert "outside the repository" in bad[2]
