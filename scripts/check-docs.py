#!/usr/bin/env python3
"""Checks the docs a newcomer reads first: the README and docs/architecture.md stay short enough
to read in one sitting, and every relative link in the repository's Markdown (README.md, docs/,
tests/README.md, deploy/README.md, web/README.md) names a file that exists and, with a
`#fragment`, a heading that file has (GitHub's anchors: lower case, punctuation dropped, spaces
as hyphens).

    python3 scripts/check-docs.py              # exit 1, naming each problem, when one is found
    python3 scripts/check-docs.py --self-test
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {"README.md": 150, "docs/architecture.md": 300}
PAGES = ["README.md", "tests/README.md", "deploy/README.md", "web/README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(text: str) -> set[str]:
    found, fenced = set(), False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(anchor(line.lstrip("#")))
    return found


def links(text: str) -> list[str]:
    """The link targets outside fenced code."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.extend(LINK.findall(line))
    return out


def problems_in(page: Path, text: str) -> list[str]:
    found = []
    for target in links(text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            found.append(f"{page.relative_to(ROOT)}: no such file: {target}")
            continue
        if fragment and dest.suffix == ".md":
            if fragment not in headings(dest.read_text()):
                found.append(f"{page.relative_to(ROOT)}: no heading #{fragment} in {path or page.name}")
    return found


def check() -> list[str]:
    found = []
    for name, limit in LIMITS.items():
        n = len((ROOT / name).read_text().splitlines())
        if n > limit:
            found.append(f"{name}: {n} lines, more than {limit}")
    pages = [ROOT / p for p in PAGES] + sorted((ROOT / "docs").glob("*.md"))
    for page in pages:
        if page.exists():
            found.extend(problems_in(page, page.read_text()))
    return found


def self_test() -> None:
    assert anchor("Routing, queueing and failover") == "routing-queueing-and-failover"
    assert anchor(" `GET /v1/models` and its fields") == "get-v1models-and-its-fields"
    text = "# Top\n```\n# not a heading [x](nowhere.md)\n```\n[a](#top) [b](#missing)\n"
    assert headings(text) == {"top"}
    assert links(text) == ["#top", "#missing"]
    page = ROOT / "docs" / "example.md"
    assert problems_in(page, "[x](architecture.md) [y](https://example.com)") == []
    assert len(problems_in(page, "[x](nowhere.md)")) == 1
    assert len(problems_in(page, "[x](architecture.md#no-such-heading)")) == 1
    print("check-docs: self-test passed")


def main() -> None:
    if "--self-test" in sys.argv:
        self_test()
        return
    found = check()
    for p in found:
        print(f"check-docs: {p}")
    if found:
        sys.exit(1)
    print("check-docs: README and architecture.md within their lengths, every link resolves")


if __name__ == "__main__":
    main()
