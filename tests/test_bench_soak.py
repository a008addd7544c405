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
    assert memory["flat"] and memory["drained"] and memory["cache_within_bound"]
    assert 0 < memory["cache_max_tokens"] <= 2048
    assert memory["samples"] >= 10 and plot_path.stat().st_size > 0
    print("\n" + result.output)


def test_soak_on_llama_cpp_with_a_suffix_draft_finds_nothing_broken(smol_path):
    """The llama.cpp backend (SmolLM2-135M, a suffix draft whose history is bounded), 15 s of the same load."""
    from specdecode.bench.soak import bench_soak
    from specdecode.pairing.pair import ModelOptions, load_pair, make_generator
    from specdecode.server import ServerSettings, create_app
    from test_server_helpers import LiveServer

    settings = ServerSettings(max_batch_size=4, max_tokens_limit=32, request_timeout=60, prefix_cache_rows=2)
    # K auto (the server's default): a seeded row is then a function of its seed alone, whatever drafted beside it
    # (with a fixed K the rejection sampler's draws follow the drafts, and the suffix history changes them)
    opts = ModelOptions(target=str(smol_path), draft="suffix", k="auto", threads=1, suffix_history_tokens=600)
    target, draft = load_pair(opts, rows=settings.model_rows)
    generator = make_generator(target, draft, opts.num_speculative_tokens, opts.method)
    with LiveServer(create_app(generator, "smol", target.tokenizer, settings)).start() as server:
        report = bench_soak(SoakSettings(url=server.url, duration_s=15, concurrency=4, max_tokens=8,
                                         scrape_every_s=0.5, replays=4))
    bad = {name: row["examples"] for name, row in report["classes"].items() if row["violations"]}
    assert report["server_errors"] == 0 and not bad, bad
    assert report["replays"]["checked"] >= 2 and report["replays"]["equal"] == report["replays"]["checked"], \
        report["replays"]
    memory = report["memory"]
    assert memory["drained"] and memory["history_within_bound"] and memory["cache_within_bound"]
    assert memory["history_max_tokens"] == 600 and memory["history_tokens_max"] > 0
    assert memory["flat"], memory


def test_memory_summary_flags_growth_and_a_cache_past_its_bound():
    grow = [{"t_s": t, "rss_bytes": 100e6 * (1 + 0.05 * t), "cache_tokens": 10 * t, "cache_max_tokens": 50}
            for t in range(10)]
    summary = memory_summary(grow, 10)
    assert not summary["flat"] and summary["rss_growth"] > 0.1 and not summary["cache_within_bound"]
    flat = [{"t_s": t, "rss_bytes": 100e6, "cache_tokens": 20} for t in range(10)]
    assert memory_summary(flat, 10)["flat"] and memory_summary(flat, 10)["cache_within_bound"]
    with pytest.raises(ValueError, match="unknown soak classes: nope"):
        SoakSettings(url="http://x", classes=("nope",))


def test_the_judge_flags_5xx_bare_4xx_and_bad_input_accepted():
    import httpx

    from specdecode.bench.soak import _judge

    def response(status, body):
        return httpx.Response(status, json=body)

    error = {"error": {"message": "prompt: must not be empty", "type": "invalid_request_error"}}
    assert _judge("malformed", response(400, error), b"{}")[0] is None
    assert "500" in _judge("malformed", response(500, error), b"{}")[0]
    assert "without an error message" in _judge("too_long", response(400, {"detail": "x"}), {})[0]
    assert "not 4xx" in _judge("unknown_model", response(200, {"choices": []}), {})[0]
    assert _judge("tools", response(400, error), {})[1] == "not_implemented"
    assert "answered 429" in _judge("completion", response(429, error), {})[0]
    ok = {"choices": [{"text": "hi", "finish_reason": "length", "logprobs": None}]}
    assert _judge("completion", response(200, ok), {}) == (None, None, "hi")
    assert "logprobs asked" in _judge("logprobs", response(200, ok), {})[0]
    assert "n=2" in _judge("n_choices", response(200, ok), {})[0]
    from specdecode.bench.soak import _check_stream

    assert _check_stream('data: {"choices": []}\n\ndata: [DONE]\n\n') is None
    assert "[DONE]" in _check_stream('data: {"choices": []}\n\n')  # cut short
    assert "error event" in _check_stream('data: {"error": {"message": "lost"}}\n\ndata: [DONE]\n\n')
