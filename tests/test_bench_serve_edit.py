"""`specdecode bench serve --workload edit`: the request sequence (speculative then plain, identical messages, turn 2
built on turn 1's speculative answer) against a fake streaming server, the summaries from given records, option
checks, and the workload and the CLI end to end against a live tiny server drafting with the suffix drafter, on
127.0.0.1 only."""

from __future__ import annotations

import json

import pytest
import typer
from fastapi import FastAPI, Request  # at module level: the app's annotations are resolved from its globals
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from specdecode import SpeculativeGenerator, SuffixDrafter
from specdecode.bench.serve_edit import (DEFAULT_FOLLOW_UP, EditBenchSettings, EditRecord, bench_edit,
                                         first_difference, summarize_edit, turn_row)
from specdecode.cli.bench_serve_cmd import bench_serve as bench_serve_command
from specdecode.server import ServerSettings, create_app
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, LiveServer, free_port

# Short, and close to the tiny tokenizer's corpus (its context is 512 tokens).
EDITS = ["Rename x to count:\ndef quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
         "Add a comment:\nimport numpy as np\nfor i in range(10):\n    print(i, i * i)\n"]
FOLLOW_UP = "Now output the whole code again."


def fake_app(bodies: list):
    """A chat server that streams "<mode> answer <n>" word by word (n: the request's number), so that the two sends
    of a turn differ; a message holding "fail" is answered 400."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        bodies.append(body)
        if any("fail" in m["content"] for m in body["messages"]):
            return JSONResponse({"error": {"message": "no"}}, status_code=400)
        plain = body.get("num_speculative_tokens") == 0
        words = f"{'plain' if plain else 'spec'} answer {len(bodies)}".split(" ")
        stats = {"proposed_tokens": 0 if plain else 4, "accepted_tokens": 0 if plain else 2,
                 "verification_steps": 2, "mean_accepted_length": 1.0 if plain else 1.5}

        def events():
            for word in words:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': word + ' '}}]})}\n\n"
            usage = {"prompt_tokens": 10, "completion_tokens": len(words), "total_tokens": 10 + len(words)}
            yield f"data: {json.dumps({'choices': [], 'usage': usage, 'speculative': stats})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_each_turn_goes_speculative_then_plain_and_turn_2_builds_on_the_speculative_answer():
    bodies = []
    with LiveServer(fake_app(bodies)) as srv:
        report = bench_edit(EditBenchSettings(url=f"{srv.url}/v1", prompts=[*EDITS, "please fail"],
                                              follow_up=FOLLOW_UP, k=3, max_tokens=8, timeout_s=30))
    assert len(bodies) == 4 + 4 + 1  # the failing prompt stops at its first send
    assert [b["num_speculative_tokens"] for b in bodies] == [3, 0] * 4 + [3]
    for b in bodies:
        assert (b["temperature"], b["max_tokens"], b["stream"]) == (0.0, 8, True)
    for first in (0, 2, 4, 6):  # the two sends of a turn carry the same messages
        assert bodies[first]["messages"] == bodies[first + 1]["messages"]
    for prompt, start in ((0, 0), (1, 4)):
        assert bodies[start]["messages"] == [{"role": "user", "content": EDITS[prompt]}]
        assert bodies[start + 2]["messages"] == [{"role": "user", "content": EDITS[prompt]},
                                                 {"role": "assistant", "content": f"spec answer {start + 1} "},
                                                 {"role": "user", "content": FOLLOW_UP}]
    assert (report["requests"], report["succeeded"], report["errors"], report["skipped"]) == (9, 8, {"400": 1}, 3)
    for row in report["per_turn"]:  # the fake's two sends differ: every pair is a mismatch, and reported
        assert (row["pairs"], row["identical"], len(row["mismatches"])) == (2, 0, 2)
        assert row["mismatches"][0] == {"prompt": 0, "first_difference": 0, "speculative_chars": 14,
                                        "plain_chars": 15}
        assert (row["speculative"]["proposed_tokens"], row["plain"]["proposed_tokens"]) == (8, 0)
        assert row["speculative"]["acceptance_rate"] == 0.5 and row["speculative"]["mean_accepted_length"] == 1.5
    assert report["mismatches"] == 4
    assert [(r["prompt"], r["turn"], r["mode"]) for r in report["per_request"]][:4] == [
        (0, 1, "speculative"), (0, 1, "plain"), (0, 2, "speculative"), (0, 2, "plain")]
    assert report["config"]["k"] == 3 and report["config"]["num_prompts"] == 3


def _record(prompt, turn, mode, tokens, ttft, last, text="same"):
    return EditRecord(prompt, 0.0, status=200, ttft_s=ttft, last_token_s=last, output_tokens=tokens, text=text,
                      conversation=prompt, turn=turn, mode=mode)


def test_decode_rates_and_speedups_from_given_records():
    records = [_record(0, 1, "speculative", 11, 0.5, 1.5), _record(0, 1, "plain", 11, 0.1, 3.1),   # 10 vs 3.33 tok/s
               _record(1, 1, "speculative", 21, 0.5, 2.5), _record(1, 1, "plain", 21, 0.1, 4.1, "other"),  # 10 vs 5
               _record(2, 1, "speculative", 1, 0.5, 0.5)]  # one token: no decode rate, and no plain send
    assert records[0].decode_tok_s == pytest.approx(10.0) and records[4].decode_tok_s is None
    row = turn_row(records, 1)
    assert (row["pairs"], row["rated_pairs"], row["identical"]) == (2, 2, 1)
    assert row["speedup_median"] == pytest.approx((3.0 + 2.0) / 2)
    assert row["speedup_of_totals"] == pytest.approx((30 / 3) / (30 / 7))  # tokens after the first / decode seconds
    assert row["speculative"]["decode_tok_s_median"] == pytest.approx(10.0)
    assert row["plain"]["decode_tok_s_median"] == pytest.approx((10 / 3 + 5) / 2)
    assert row["speculative"]["ttft_median_s"] == 0.5 and row["plain"]["ttft_median_s"] == pytest.approx(0.1)
    assert row["mismatches"] == [{"prompt": 1, "first_difference": 0, "speculative_chars": 4, "plain_chars": 5}]
    assert row["speculative"]["proposed_tokens"] is None  # no statistics reported
    empty = turn_row(records, 2)
    assert (empty["pairs"], empty["speedup_median"], empty["speedup_of_totals"]) == (0, None, None)
    report = summarize_edit(records, 2.0, EditBenchSettings(url="x", prompts=["a", "b", "c"]))
    assert (report["requests"], report["skipped"], report["mismatches"]) == (5, 12 - 5, 1)
    assert first_difference("abcd", "abxd") == 2 and first_difference("ab", "abc") == 2


def test_settings_defaults_and_checks():
    settings = EditBenchSettings(url="x")
    assert len(settings.prompts) == 8 and all("output the whole" in p for p in settings.prompts)
    assert (settings.max_tokens, settings.k, settings.follow_up, settings.planned) == (256, "auto",
                                                                                      DEFAULT_FOLLOW_UP, 32)
    assert EditBenchSettings(url="x", nb_prompts=3, k="4").prompts == settings.prompts[:3]
    assert EditBenchSettings(url="x", k="4").k == 4
    for bad, message in [({"temperature": 0.7}, "temperature must be 0"), ({"max_tokens": 1}, "max_tokens must be"),
                         ({"k": 0}, "must be 'auto' or an integer 1..32"), ({"k": "x"}, "got 'x'"),
                         ({"k": 99}, "got 99"), ({"nb_prompts": 0}, "nb_prompts must be >= 1"),
                         ({"follow_up": " "}, "is empty")]:
        with pytest.raises(ValueError, match=message):
            EditBenchSettings(url="x", **bad)


@pytest.fixture(scope="module")
def suffix_server(tiny_pair, tokenizer):
    """The tiny target drafted by the suffix drafter (the server's `--draft suffix`), the prefix cache on."""
    target, _ = tiny_pair
    generator = SpeculativeGenerator(target, SuffixDrafter(), num_speculative_tokens=4, tokenizer=tokenizer)
    srv = LiveServer(create_app(generator, MODEL, tokenizer, ServerSettings(draft_name="suffix"))).start()
    yield srv
    srv.stop()


def test_edit_on_a_live_server_gives_the_same_text_both_ways(suffix_server):
    report = bench_edit(EditBenchSettings(url=suffix_server.url, prompts=EDITS, follow_up=FOLLOW_UP, max_tokens=8,
                                          ignore_eos=True, timeout_s=60))
    assert (report["requests"], report["succeeded"], report["errors"], report["skipped"]) == (8, 8, {}, 0)
    assert report["mismatches"] == 0 and report["output_tokens"] == 8 * 8
    for row in report["per_turn"]:
        spec, plain = row["speculative"], row["plain"]
        assert (row["pairs"], row["rated_pairs"], row["identical"]) == (2, 2, 2)
        assert spec["decode_tok_s_median"] > 0 and plain["decode_tok_s_median"] > 0 and row["speedup_median"] > 0
        assert plain["proposed_tokens"] == 0  # num_speculative_tokens 0: plain decoding on the same server
        assert plain["cached_tokens"] > 0  # the plain send, second, finds the prompt in the prefix cache
    turn1, turn2 = report["per_turn"]
    assert turn2["speculative"]["prompt_tokens"] > turn1["speculative"]["prompt_tokens"]  # the re-sent history
    assert turn2["speculative"]["proposed_tokens"] > 0  # the suffix draft has turn 1 to copy from


def _cli():
    cli = typer.Typer()
    cli.command()(bench_serve_command)
    return cli


def test_cli_runs_the_edit_workload_and_writes_json(suffix_server, tmp_path):
    (tmp_path / "edits.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in EDITS))
    result = CliRunner().invoke(_cli(), ["--url", suffix_server.url, "--workload", "edit", "--prompts",
                                         str(tmp_path / "edits.jsonl"), "--nb-prompts", "1", "--max-tokens", "6",
                                         "-k", "3", "--follow-up", FOLLOW_UP, "--json", str(tmp_path / "edit.json")])
    assert result.exit_code == 0, result.output
    assert "edit: 4/4 requests succeeded" in result.output and "same" in result.output
    assert "differ" not in result.output and "no plain baseline" not in result.output
    report = json.loads((tmp_path / "edit.json").read_text())
    assert report["workload"] == "edit" and [row["turn"] for row in report["per_turn"]] == [1, 2]
    assert report["config"]["k"] == 3 and report["config"]["max_tokens"] == 6
    assert report["config"]["prompts"] == str(tmp_path / "edits.jsonl")
    assert [(r["turn"], r["mode"]) for r in report["per_request"]] == [(1, "speculative"), (1, "plain"),
                                                                       (2, "speculative"), (2, "plain")]


@pytest.mark.parametrize("args, message", [
    (["--workload", "edit", "--turns", "3"], "--turns does not apply to --workload edit"),
    (["--workload", "multi-turn", "-k", "3"], "-k does not apply to --workload multi-turn"),
    (["--follow-up", "x"], "--follow-up does not apply to --workload completions"),
    (["--workload", "edit", "--temperature", "0.7"], "--temperature must be 0"),
    (["--workload", "edit", "-k", "0"], "-k (the speculative send's num_speculative_tokens) must be 'auto'"),
    (["--workload", "edit", "--nb-prompts", "0"], "--nb-prompts must be >= 1"),
    (["--workload", "edit", "--max-tokens", "1"], "--max-tokens must be >= 2"),
    (["--workload", "edit", "--prompts", "nowhere.jsonl"], "neither a built-in set"),
])
def test_cli_checks_the_edit_options(args, message):
    result = CliRunner().invoke(_cli(), ["--url", f"http://127.0.0.1:{free_port()}", *args])
    assert result.exit_code != 0 and message in " ".join(result.output.split()), result.output
