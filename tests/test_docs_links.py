"""The docs as a product: every relative link of the README and docs/ resolves (files and #anchors), every plot in
docs/img is shown somewhere, the README stays short with the install, the first command and the expected speedup on
its first screen, and the user pages state what holds now (dates, sessions and commit hashes belong to the journal).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# The pages where history is the point: the journal, and the results page, whose figures carry their dates.
HISTORY = {"JOURNAL.md"}
DATED = {"JOURNAL.md", "RESULTS.md"}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text without its code blocks: what a reader sees as prose, links and headings."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, _ and - kept), spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(prose(path.read_text(encoding="utf-8"))):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = INLINE_CODE.sub("code", prose(path.read_text(encoding="utf-8")))
    return LINK.findall(text)


def broken_links(page: Path) -> list[str]:
    """The relative links of a page whose file does not exist or whose #anchor names no heading there."""
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.name}: {target} (no such heading in {dest.name})")
    return broken


def test_every_relative_link_resolves():
    broken = [b for page in pages() for b in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## A heading, with `code` — and ≥ 2×\n\n[ok](#a-heading-with-code--and--2) [bad](#nope) "
                    "[gone](x.md) [web](https://example.com) `[not a link](y.md)`\n\n```\n[in code](z.md)\n```\n")
    assert broken_links(page) == ["page.md: #nope (no such heading in page.md)", "page.md: x.md (no such file)"]


def test_every_plot_is_shown_where_it_belongs():
    shown = set()
    for page in pages():
        for target in IMAGE.findall(prose(page.read_text(encoding="utf-8"))):
            shown.add((page.parent / target).resolve())
    plots = sorted((DOCS / "img").glob("*.png"))
    assert plots
    hidden = [p.name for p in plots if p.resolve() not in shown]
    assert not hidden, f"plots no page shows (embed them where they belong or delete them): {hidden}"


def test_the_readme_reads_in_two_minutes():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 200, len(lines)
    assert len(text.encode("utf-8")) <= 15 * 1024, len(text.encode("utf-8"))
    first = "\n".join(lines[:60])
    assert "bash scripts/install.sh" in first, "the install within the first 60 lines"
    assert "specdecode generate" in first, "the first command within the first 60 lines"
    assert re.search(r"\*\*\d\.\d\d×\*\*", first), "the expected speedup within the first 60 lines"
    assert "specdecode advise" in first
    assert "](docs/img/" in first, "a plot on the first screen"
    from test_docs_results import plot_results

    for hardware in {row.hardware for row in plot_results().summary_rows()}:
        assert hardware in first, f"the speedups name their hardware: {hardware}"


# What belongs to the journal: dates, sessions and turns of work, commit hashes, and places only the writer knew.
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
SESSION = re.compile(r"\b(?:(?:first|second|third|fourth|fifth|sixth|seventh|eighth|last|this|previous|earlier|"
                     r"same|next|that) session|session \d+|this turn|a turn ago|last turn)\b", re.I)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b")
DEICTIC = re.compile(r"\b(?:here|this CPU|this machine|this VM|this project's|our 2-core)\b", re.I)


def _visible(text: str) -> str:
    """Prose without link targets (an anchor of a dated journal heading is not a date in the text) and without
    quoted output (a first run prints "not timed on this machine yet")."""
    return re.sub(r'"[^"]{0,60}"', '""', re.sub(r"\]\([^)]*\)", "]", text))


@pytest.mark.parametrize("page", [p for p in pages() if p.name not in HISTORY], ids=lambda p: p.name)
def test_user_pages_state_what_holds_now(page):
    text = _visible(page.read_text(encoding="utf-8"))
    found = {name: sorted(set(m.group(0) for m in pattern.finditer(text)))
             for name, pattern in (("dates", DATE), ("session words", SESSION), ("commit hashes", COMMIT),
                                   ("here / this CPU", DEICTIC))
             if not (name == "dates" and page.name in DATED)}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"{page.name}: {found} (history goes to docs/JOURNAL.md; name the hardware)"


def test_the_checks_catch_what_they_are_for():
    assert DATE.search("measured 2026-11-26") and not DATE.search("1,117,320,768 bytes")
    assert SESSION.search("in the last session") and SESSION.search("fifth session") and SESSION.search("session 3")
    assert not SESSION.search("coding-agent sessions") and not SESSION.search("gen.session()")
    assert COMMIT.search("before commit 3592ee2") and COMMIT.search("(a1aeceb)")
    assert not COMMIT.search("cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
    assert not COMMIT.search("deadbeef") and not COMMIT.search("1234567")
    assert DEICTIC.search("on this CPU it does not pay") and DEICTIC.search("measured here")
    assert not DEICTIC.search("where it pays, and there")
