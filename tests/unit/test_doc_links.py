"""Every relative link in the README and docs/ names a file, and its anchor a heading."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / "bench" / "RESULTS.md",
    ROOT / "research" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)}


def _broken(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text())
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("<"):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    return broken


def test_every_relative_link_resolves() -> None:
    broken = {str(p.relative_to(ROOT)): b for p in PAGES if p.exists() and (b := _broken(p))}
    assert broken == {}


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A title\n[ok](a.md#a-title) [bad](b.md) [bad2](a.md#nope)\n")
    assert _broken(tmp_path / "a.md") == ["b.md (no such file)", "a.md#nope (no such heading)"]
