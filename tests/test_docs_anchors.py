"""Every link to a heading in the README and docs/ reaches one (issue 32's review: two
links to batch.md named an anchor GitHub does not make, and one in config.md a heading
canary.md no longer has). Anchors as GitHub makes them: the heading's text lowercased,
punctuation but `-` and `_` dropped, spaces as `-`, a repeated heading suffixed -1, -2."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"\]\(([^)\s]*?)#([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of `text` (none inside fenced code)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(2).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(files: list[Path]) -> list[str]:
    """`file: target#anchor` for each link to a Markdown heading that does not exist."""
    bad = []
    for f in files:
        for m in _LINK.finditer(f.read_text()):
            target, anchor = m.group(1), m.group(2)
            page = f if not target else f.parent / target
            if page.suffix != ".md" or not page.exists():
                continue  # not a Markdown page of the repository (a URL, a source file)
            if anchor not in anchors(page.read_text()):
                where = f.relative_to(REPO) if f.is_relative_to(REPO) else f.name
                bad.append(f"{where}: {target}#{anchor}")
    return bad


def test_every_link_to_a_heading_reaches_one() -> None:
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    assert len(files) > 10
    assert broken_links(files) == []


def test_the_check_finds_a_link_to_a_heading_that_is_not_there(tmp_path: Path) -> None:
    page = tmp_path / "a.md"
    page.write_text(
        "# What the farm writes: `[gateway] priority_user_share`\n\n## Twice\n\n## Twice\n\n"
        "[ok](#what-the-farm-writes-gateway-priority_user_share) [ok](#twice-1)\n"
        "[bad](#what-the-farm-writes-gatewaypriority_user_share) [bad](a.md#twice-2)\n"
        "```\n# not a heading\n```\n[bad](#not-a-heading)\n"
    )
    found = broken_links([page])
    assert [line.split(": ", 1)[1] for line in found] == [
        "#what-the-farm-writes-gatewaypriority_user_share",
        "a.md#twice-2",
        "#not-a-heading",
    ]
