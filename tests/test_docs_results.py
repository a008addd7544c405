"""The results page and the README's summary are scripts/plot_results.py's: their tables are what it prints from
docs/results/*.json, every figure in docs/img is one it makes (or the playground's screenshot), and it makes them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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


def test_the_matrix_tables_are_the_scripts():
    script = plot_results()
    results = (ROOT / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    assert {source for sources, *_ in script.MATRIX_RUNS for source in sources} <= set(script.MATRIX_TABLES)
    for source in script.MATRIX_TABLES:
        assert script.matrix_table(source) in results, f"RESULTS.md: python scripts/plot_results.py --matrix {source}"
        assert f"(results/{source})" in results, f"docs/RESULTS.md does not link {source}"
    for source in script.AIDER_TABLES:
        assert script.aider_table(source) in results, f"RESULTS.md: python scripts/plot_results.py --aider {source}"
        assert f"(results/{source})" in results, f"docs/RESULTS.md does not link {source}"


def test_every_row_names_its_source_hardware_peer_and_command():
    for row in plot_results().summary_rows():
        assert (ROOT / "docs" / "results" / row.source).is_file(), row.source
        for source in row.also:
            assert (ROOT / "docs" / "results" / source).is_file(), source
        assert row.hardware and row.peer and row.command.startswith("`") and row.date
        assert row.speedup > 0


def test_the_page_says_where_we_are_slower():
    rows = plot_results().summary_rows()
    slower = [row for row in rows if row.speedup < 1]
    results = (ROOT / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    for row in slower:
        assert "(slower)" in row.result()
    assert not slower or "Where we are slower" in results


def test_every_figure_in_docs_img_is_made_by_the_script(tmp_path):
    script = plot_results()
    on_disk = {p.name for p in (ROOT / "docs" / "img").glob("*.png")}
    assert on_disk == set(script.FIGURES) | SCREENSHOTS
    for name, make in script.FIGURES.items():
        make(tmp_path / name)
        assert (tmp_path / name).stat().st_size > 10_000, name
