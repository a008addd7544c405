"""A sentence in the docs is a promise, and a promise names its test: every row of the README's guarantees table
names at least one test, and every test that the README and the docs name by file (tests/test_x.py) or by function
(tests/test_x.py::test_y) exists, so a renamed or deleted test cannot leave a promise backed by nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NAMED = re.compile(r"tests/(test_\w+)\.py(?:::(test_\w+))?")


def guarantee_rows() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Guarantees\n")
    end = text.index("\n## ", start + 1)
    rows = [line for line in text[start:end].splitlines() if line.startswith("|")]
    assert rows[0].startswith("| promise | test | page |") and set(rows[1]) <= set("|-")
    return rows[2:]


def missing(file: str, test: str | None) -> bool:
    path = ROOT / "tests" / f"{file}.py"
    if not path.is_file():
        return True
    return bool(test) and re.search(rf"^(async )?def {test}\(", path.read_text(encoding="utf-8"), re.M) is None


def test_every_guarantee_names_a_test_that_exists():
    rows = guarantee_rows()
    assert len(rows) >= 12
    for row in rows:
        promise, tests, page = (cell.strip() for cell in row.strip("|").split("|"))
        named = NAMED.findall(tests)
        assert named and all(test for _, test in named), f"a promise without a test function: {promise}"
        gone = [f"{f}::{t}" for f, t in named if missing(f, t)]
        assert not gone, f"{promise}: {gone}"
        assert "](docs/" in page, f"{promise}: no page"


def test_every_test_the_docs_name_exists():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    gone = {f"{page.name}: tests/{f}.py" + (f"::{t}" if t else "")
            for page in pages if page.name != "JOURNAL.md"
            for f, t in NAMED.findall(page.read_text(encoding="utf-8")) if missing(f, t)}
    assert not gone, sorted(gone)


def test_the_check_catches_a_missing_test():
    assert missing("test_distribution", "test_no_such_test")
    assert missing("test_no_such_file", None)
    assert not missing("test_distribution", "test_adaptive_k_keeps_the_target_distribution")
