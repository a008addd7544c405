"""scripts/ holds only what a current page or a test names: a script that reproduces a figure of the docs, or one
the tests, CI or the install run. One-off experiments are retired with `git rm` once nothing current cites them
(git keeps them; docs/JOURNAL.md, the history, may still name them and does not count)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def citing_texts() -> dict[str, str]:
    """path -> text of every current page, test, CI and deployment file (and pyproject.toml)."""
    pages = [ROOT / "README.md", ROOT / "pyproject.toml", *(ROOT / "docs").glob("*.md")]
    pages = [p for p in pages if p.name != "JOURNAL.md"]
    for folder in ("tests", ".ci", "deploy"):
        pages += [p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    own = Path(__file__).resolve()
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8", errors="replace") for p in pages
            if p.resolve() != own}


def scripts() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in SCRIPTS.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def test_every_script_is_cited_by_a_current_page_or_a_test():
    texts = citing_texts()
    uncited = [s for s in scripts() if not any(s in text for text in texts.values())]
    assert not uncited, (f"{uncited}: cite each from the page whose figure it reproduces (or the test that runs it), "
                         f"or retire it with git rm")


def test_the_check_sees_the_scripts():
    assert {"scripts/install.sh", "scripts/plot_results.py"} <= set(scripts())
