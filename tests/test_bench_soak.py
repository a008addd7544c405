"""`specdecode bench soak` on the tiny models for a bounded ~20 s, against a server it starts itself (`--serve`) with
every cache's bound set small: a mixed, faulty load (streams dropped, cancellations, malformed bodies, over-long
prompts, unknown models, client timeouts beside well-formed requests of every kind) gets no 5xx, a 4xx with a message
for every bad request, the same answer for greedy and seeded requests sent again alone, memory flat after warm-up,
every cache full by the end of the warm-up and within its bound, and the end-of-soak report of what each cache
holds; the report and plot are written."""

from __future__ import annotations

import json

import pytest

from specdecode.bench.soak import CLASSES, SoakSettings, memory_summary
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)


def test_soak_on_the_tiny_models_finds_nothing_broken(tiny_model_dirs, tmp_path):
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    report_path, plot_path = tmp_path / "soak.json", tmp_path / "soak.png"
    serve = (f"--target {tiny_model_dirs['target']} --draft suffix+{tiny_model_dirs['draft']} --threads 1 "
             f"--max-batch-size 4 --max-queue 64 --max-tokens-limit 64 --request-timeout 30")
    result = CliRunner().invoke(app, ["bench", "soak", "--serve", serve, "--prefix-cache-tokens", "128",
                                      "--suffix-history-tokens", "256", "--grammar-cache", "2", "--kernel-cache", "32",
                                      "--duration", "20", "--concurrency", "4", "--max-tokens", "12",
                                      "--scrape-every", "0.5", "--json", str(report_path), "--plot", str(plot_path),
                                      "--check"])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
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
    assert memory["flat"] and memory["drained"] and memory["cache_within_bound"] and memory["grammar_within_bound"]
    assert memory["cache_max_tokens"] == 128 and memory["history_max_tokens"] == 256
    assert memory["samples"] >= 10 and plot_path.stat().st_size > 0
    # the bounds reached the server, each cache was full when the warm-up ended, and the report says what each held
    assert report["serve"]["env"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32", "LRU_CACHE_CAPACITY": "32"}
    assert report["primed"] == {"tokens": 510, "status": 200}  # the longest prompt the 512-token context takes
    assert report["config"]["schemas"] == 16 and memory["filled_in_warmup"] == {
        "prefix_cache": True, "suffix_history": True, "grammar_cache": True}, memory["filled_in_warmup"]
    end = memory["caches_at_end"]
    assert end["grammar_cache"] == {"entries": 2, "max_entries": 2}
    assert 0 < end["prefix_cache"]["tokens"] <= 128 and end["prefix_cache"]["entries"] >= 1
    assert end["prefix_cache"]["evictions"] > 0 and end["prefix_cache"]["mib"] > 0
    assert 0 < end["suffix_history"]["tokens"] <= 256
    assert 0 < end["token_texts"]["entries"] <= end["token_texts"]["max_entries"] == 320  # logprobs named tokens
    assert end["rss_mib"] > 0 and end["malloc_in_use_mib"] > 0
    assert memory["measured_requests"] > 0 and "malloc_kib_per_request" in memory
    for line in ("caches at the end: prefix cache", "grammars 2 of 2  (at its bound by the end of warm-up)",
                 "kept per request after warm-up", "second half, idle to idle"):
        assert line in result.output, result.output
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


def test_memory_summary_judges_the_second_half_and_what_stays_per_request():
    from specdecode.bench.soak_memory import filled

    bound = {"cache_max_tokens": 100, "cache_tokens": 95, "history_max_tokens": 50, "history_tokens": 10,
             "grammar_max_entries": 4, "grammar_entries": 4}
    load = [{"t_s": t, "rss_bytes": 100e6 + (t % 3) * 1e6, "malloc_bytes": 50e6, **bound} for t in range(40)]
    load[35]["rss_bytes"] = 105e6  # a peak under load: requests in flight, not kept
    warm, half = {**load[9], "t_s": 9.5}, {**load[19], "t_s": 19.5, "rss_bytes": 100.5e6}
    end = {**load[-1], "rss_bytes": 101e6, "malloc_bytes": 50.5e6}
    summary = memory_summary(load, 40, warm, end, 1000, half, 500)
    assert summary["second_half_flat"] and summary["rss_second_half_growth"] == pytest.approx(0.5 / 100.5)
    assert summary["rss_second_half_peak_growth"] == pytest.approx(3 / 102)  # reported beside, not judged
    assert summary["rss_kib_per_request"] == pytest.approx(1e6 / 1024 / 1000)
    assert summary["malloc_kib_per_request"] == pytest.approx(0.5e6 / 1024 / 1000)
    assert summary["rss_second_half_kib_per_request"] == pytest.approx(0.5e6 / 1024 / 500)
    # the history held 10 of its 50 tokens when the warm-up ended: not full, so growth after it is ambiguous
    assert summary["filled_in_warmup"] == {"prefix_cache": True, "suffix_history": False, "grammar_cache": True}
    assert summary["caches_at_end"]["grammar_cache"] == {"entries": 4, "max_entries": 4}
    assert filled([{"cache_max_tokens": 100, "cache_tokens": 10, "cache_evictions": 3}]) == {"prefix_cache": True}
    # an LRU at its bound holds up to an entry less: what it reached counts, not what it held at the last scrape
    assert filled([{"history_max_tokens": 50, "history_tokens": n} for n in (49, 30)]) == {"suffix_history": True}
    grew = memory_summary(load, 40, warm, {**end, "rss_bytes": 103e6}, 1000, half, 500)
    assert not grew["second_half_flat"] and grew["rss_second_half_growth"] > 0.02
    rising = [{**x, "rss_bytes": 100e6 * (1 + 0.002 * x["t_s"])} for x in load]  # no idle points: peaks judged
    summary = memory_summary(rising, 40, warm)
    assert not summary["second_half_flat"] and summary["rss_second_half_peak_growth"] > 0.02
    assert "rss_kib_per_request" not in summary  # no idle point after the load: nothing said per request
    over = [{**x, "grammar_entries": 5} for x in load]
    assert not memory_summary(over, 40)["grammar_within_bound"]


def test_the_cache_bounds_go_to_the_server_the_soak_starts():
    from typer.testing import CliRunner

    from specdecode.bench.soak_server import CacheBounds, SoakServer
    from specdecode.cli.app import app

    bounds = CacheBounds(prefix_cache_tokens=0, suffix_history_tokens=600, grammar_cache=4, kernel_cache=64)
    server = SoakServer("--target some/dir --prefix-cache-tokens 9 --threads 1", bounds)
    assert server.command[server.command.index("serve") + 1:] == [
        "--target", "some/dir", "--prefix-cache-tokens", "9", "--threads", "1", "--host", "127.0.0.1", "--port",
        str(server.port), "--prefix-cache-tokens", "0", "--suffix-history-tokens", "600", "--grammar-cache", "4"]
    assert server.env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}
    assert SoakServer("--target x", CacheBounds()).env == {} and not CacheBounds().given
    with pytest.raises(ValueError, match="leave --port out"):
        SoakServer("--target x --port 8000")
    with pytest.raises(ValueError, match="grammar_cache must be an integer >= 1"):
        CacheBounds(grammar_cache=0)
    result = CliRunner().invoke(app, ["bench", "soak", "--url", "http://127.0.0.1:9", "--grammar-cache", "4"])
    assert result.exit_code != 0 and "give --serve" in result.output, result.output


def test_the_grammar_cache_keeps_its_bound(tiny_pair, tokenizer):
    from specdecode import SpeculativeGenerator
    from specdecode.errors import OptionError
    from specdecode.server import ServerSettings

    generator = SpeculativeGenerator(*tiny_pair, num_speculative_tokens=2, tokenizer=tokenizer)
    assert generator.grammar_cache() is None  # nothing compiled yet
    generator.set_grammar_cache(2)
    # The compiler is shared by every generator of this tokenizer, and so by the tests this worker ran before:
    # schemas no other test compiles, and the misses counted from here.
    schemas = [{"type": "object", "properties": {"bound": {"type": "string", "maxLength": n}}} for n in (3, 4, 5, 6)]
    try:
        generator.generate(["w"], max_new_tokens=1, temperature=0, json_schema=schemas[3])
        before = generator.grammar_cache().misses
        generator.generate(["x", "y", "z"], max_new_tokens=1, temperature=0, json_schema=schemas[:3])
        info = generator.grammar_cache()
    finally:  # leave its bound as it was
        generator.set_grammar_cache(64)
    assert (info.maxsize, info.currsize, info.misses - before) == (2, 2, 3)
    with pytest.raises(ValueError, match="integer >= 1"):
        generator.set_grammar_cache(0)
    with pytest.raises(OptionError, match="grammar_cache_entries"):
        ServerSettings(grammar_cache_entries=0)
