"""`specdecode bench soak` on the tiny models for a bounded ~20 s: a mixed, faulty load (streams dropped,
cancellations, malformed bodies, over-long prompts, unknown models, client timeouts beside well-formed requests of
every kind) gets no 5xx, a 4xx with a message for every bad request, the same answer for greedy and seeded requests
sent again alone, memory flat after warm-up and the prefix cache within its bound; the report and plot are written."""

from __future__ import annotations

import json

import pytest

from specdecode.bench.soak import CLASSES, SoakSettings, memory_summary
from test_server_helpers import one_torch_thread, serve  # noqa: F401  (an autouse fixture)


def test_soak_on_the_tiny_models_finds_nothing_broken(tiny_pair, tokenizer, tmp_path):
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    report_path, plot_path = tmp_path / "soak.json", tmp_path / "soak.png"
    with serve(tiny_pair, tokenizer, max_batch_size=4, max_queue=64, max_tokens_limit=64, request_timeout=30,
               prefix_cache_tokens=2048) as server:
        result = CliRunner().invoke(app, ["bench", "soak", "--url", server.url, "--duration", "20",
                                          "--concurrency", "4", "--max-tokens", "12", "--scrape-every", "0.5",
                                          "--json", str(report_path), "--plot", str(plot_path), "--check"])
    report = json.loads(report_path.read_text())
    assert result.exit_code == 0, result.output
    assert report["ok"] and report["server_errors"] == 0 and report["violations"] == 0, result.output
    for name in CLASSES:
        row = report["classes"][name]
        assert row["sent"] >= 2, (name, row)
        if name in ("malformed", "too_long", "unknown_model"):
            assert set(row["status"]) <= {"400", "404", "413", "422"}, (name, row)
        elif name == "tools":  # answered, or refused with a 400 while tool calling is not served
            assert set(row["status"]) <= {"200", "400"}
        elif name not in ("drop_stream", "cancel", "client_timeout"):
            assert set(row["status"]) == {"200"}, (name, row)
    assert report["replays"]["checked"] >= 4 and report["replays"]["equal"] == report["replays"]["checked"]
    memory = report["memory"]
    assert memory["flat"] and memory["cache_within_bound"] and 0 < memory["cache_max_tokens"] <= 2048
    assert memory["samples"] >= 10 and plot_path.stat().st_size > 0
    print("\n" + result.output)


def test_memory_summary_flags_growth_and_a_cache_past_its_bound():
    grow = [{"t_s": t, "rss_bytes": 100e6 * (1 + 0.05 * t), "cache_tokens": 10 * t, "cache_max_tokens": 50}
            for t in range(10)]
    summary = memory_summary(grow, 10)
    assert not summary["flat"] and summary["rss_growth"] > 0.1 and not summary["cache_within_bound"]
    flat = [{"t_s": t, "rss_bytes": 100e6, "cache_tokens": 20} for t in range(10)]
    assert memory_summary(flat, 10)["flat"] and memory_summary(flat, 10)["cache_within_bound"]
    with pytest.raises(ValueError, match="unknown soak classes: nope"):
        SoakSettings(url="http://x", classes=("nope",))
