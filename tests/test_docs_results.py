"""The results page and the README's summary are scripts/plot_results.py's: their tables are what it prints from
docs/results/*.json, every figure in docs/img is one it makes (or the playground's screenshot), and it makes them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = {"playground.png"}  # scripts/playground_screenshot.py, not a plot of results


def plot_results():
    spec = importlib.util.spec_from_file_location("plot_results", ROOT / "scripts" / "plot_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_summary_tables_are_the_scripts():
    script = plot_results()
    results = (ROOT / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert script.summary_table(dated=True) in results, "docs/RESULTS.md: run python scripts/plot_results.py --table"
    assert script.summary_table(dated=False) in readme, "README.md: run python scripts/plot_results.py --table --undated"


def test_the_corpus_tables_are_the_scripts_and_the_retired_ones_are_in_the_journal():
    """The results page shows the corpus runs (end to end, against every llama-server mode); the matrix and aider
    runs, from older code and other measures, are history: the journal keeps their tables."""
    script = plot_results()
    results = (ROOT / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    journal = (ROOT / "docs" / "JOURNAL.md").read_text(encoding="utf-8")
    assert script.CORPUS_RUNS
    for source, _ in script.CORPUS_RUNS:
        assert script.corpus_table(source) in results, f"RESULTS.md: python scripts/plot_results.py --corpus {source}"
        assert f"(results/{source})" in results, f"docs/RESULTS.md does not link {source}"
    assert {source for sources, *_ in script.MATRIX_RUNS for source in sources} <= set(script.MATRIX_TABLES)
    for source in script.MATRIX_TABLES:
        assert script.matrix_table(source) in journal, f"JOURNAL.md: python scripts/plot_results.py --matrix {source}"
        assert "--workload matrix" not in results
    for source in script.AIDER_TABLES:
        assert script.aider_table(source) in journal, f"JOURNAL.md: python scripts/plot_results.py --aider {source}"


def test_every_summary_row_is_against_the_best_peer_of_its_run():
    """A corpus row sums, over its kinds, our seconds and the fastest llama-server mode's of each kind."""
    script = plot_results()
    for source, date in script.CORPUS_RUNS:
        report = script.load(source)
        rows = {row.workload.split(":")[0]: row for row in script.corpus_rows(source, date)}
        assert rows
        for label, marker in script.CORPUS_GROUPS:
            kinds = [k for k in report["summary"] if marker in k["kind"] and k["best_peer"]]
            fastest = sum(min(k["servers"][s]["seconds"] for s in report["config"]["servers"]
                              if s != "ours" and k["servers"][s]["seconds"] is not None) for k in kinds)
            assert rows[label].peer_value == pytest.approx(fastest), label
