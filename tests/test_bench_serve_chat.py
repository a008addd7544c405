"""`specdecode bench serve --workload multi-turn | shared-system` against live servers on 127.0.0.1 over the tiny
models: the report's shape, prefix reuse seen through usage.prompt_tokens_details.cached_tokens with the server's
prefix cache on and off, errors counted rather than raised, and the CLI."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from specdecode.bench.serve_chat import ChatBenchSettings, bench_chat
from specdecode.cli.bench_serve_cmd import bench_serve as bench_serve_command
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import free_port, serve

# Short, and close to the tiny tokenizer's corpus: its context is 512 tokens and it spends few tokens on these.
SYSTEM = "You review Python code. def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n"
QUESTIONS = ["The quick brown fox", "import numpy as np", "class Model:\n    pass", "for i in range(10):"]


@pytest.fixture(scope="module")
def servers(tiny_pair, tokenizer):
    """Two servers on the tiny pair: the prefix cache on (the default) and off."""
    cached = serve(tiny_pair, tokenizer, k=3, max_batch_size=4)
    cold = serve(tiny_pair, tokenizer, k=3, max_batch_size=4, prefix_cache_tokens=0)
    yield {"on": cached, "off": cold}
    cached.stop()
    cold.stop()


def _settings(url: str, **overrides) -> ChatBenchSettings:
    options = dict(url=url, system_prompt=SYSTEM, questions=QUESTIONS, max_tokens=6, ignore_eos=True,
                   timeout_s=60, duration_s=120)
    return ChatBenchSettings(**{**options, **overrides})


def test_settings_and_built_in_texts():
    settings = ChatBenchSettings(url="http://127.0.0.1:1")
    assert len(settings.questions) >= 4 and all(q.strip() for q in settings.questions)
    assert "code review" in settings.system_prompt and len(settings.system_prompt) > 3000  # ~900 Qwen tokens
    assert settings.planned == 4 * 5 and ChatBenchSettings(url="x", workload="shared-system").planned == 16
    assert ChatBenchSettings(url="x").run_id != settings.run_id  # each run its own cold prefix
    with pytest.raises(ValueError, match="workload"):
        ChatBenchSettings(url="x", workload="completions")
    with pytest.raises(ValueError, match="turns must be >= 1"):
        ChatBenchSettings(url="x", turns=0)


@pytest.mark.parametrize("cache", ["on", "off"])
def test_multi_turn_reports_each_turn_and_its_reuse(servers, cache):
    report = bench_chat(_settings(f"{servers[cache].url}/v1", conversations=2, turns=3))
    assert report["workload"] == "multi-turn" and report["errors"] == {} and report["skipped"] == 0
    assert report["requests"] == report["succeeded"] == 6 and report["output_tokens"] == 6 * 6
    assert report["output_tokens_per_s"] > 0
    assert [row["turn"] for row in report["per_turn"]] == [1, 2, 3]
    prompts = [row["prompt_tokens"] for row in report["per_turn"]]
    assert prompts == sorted(prompts) and prompts[0] < prompts[-1]  # each turn re-sends the growing history
    for row in report["per_turn"]:
        assert (row["requests"], row["succeeded"]) == (2, 2)
        assert 0 < row["ttft_median_s"] <= row["ttft_p90_s"]
    assert report["per_turn"][0]["cached_tokens"] == 0  # conversations share no prefix: turn 1 is cold
    later = report["per_turn"][1:]
    if cache == "on":
        assert all(row["cached_tokens"] > 0 and row["hit_rate"] > 0 for row in later)
        assert all(r["cached_tokens"] > 0 for r in report["per_request"] if r["turn"] >= 2)
    else:
        assert all(row["cached_tokens"] == 0 and row["hit_rate"] == 0 for row in later)
    assert report["ttft_last_vs_first"] > 0
    assert {(r["conversation"], r["turn"]) for r in report["per_request"]} == {(c, t) for c in (0, 1)
                                                                                for t in (1, 2, 3)}


@pytest.mark.parametrize("cache", ["on", "off"])
def test_shared_system_prompt_first_against_later(servers, cache):
    report = bench_chat(_settings(servers[cache].url, workload="shared-system", num_requests=4, concurrency=2))
    assert report["workload"] == "shared-system" and report["errors"] == {}
    assert report["requests"] == report["succeeded"] == 4
    first, later = report["per_group"]
    assert (first["group"], first["requests"], later["group"], later["requests"]) == ("first", 1, "later", 3)
    assert first["cached_tokens"] == 0  # the run's tag keeps its first prefill cold
    if cache == "on":
        assert later["cached_tokens"] > 0 and 0 < report["hit_rate"] < 1
    else:
        assert later["cached_tokens"] == 0 and report["hit_rate"] == 0
    assert report["ttft_last_vs_first"] == later["ttft_median_s"] / first["ttft_median_s"]


def test_errors_are_counted_and_a_failed_turn_ends_its_conversation(tiny_pair, tokenizer):
    with serve(tiny_pair, tokenizer, k=3, max_tokens_limit=4) as srv:  # max_tokens 6 > 4: every request is a 400
        chats = bench_chat(_settings(srv.url, conversations=2, turns=3))
        shared = bench_chat(_settings(srv.url, workload="shared-system", num_requests=3, concurrency=2))
    assert (chats["requests"], chats["failed"], chats["errors"], chats["skipped"]) == (2, 2, {"400": 2}, 4)
    assert chats["per_turn"][1] == {"turn": 2, "requests": 0, "succeeded": 0, "ttft_median_s": None,
                                    "ttft_p90_s": None, "prompt_tokens": None, "cached_tokens": None,
                                    "hit_rate": None}
    assert (shared["requests"], shared["succeeded"], shared["errors"]) == (3, 0, {"400": 3})
    assert shared["ttft_last_vs_first"] is None
    nobody = bench_chat(_settings(f"http://127.0.0.1:{free_port()}", workload="shared-system", num_requests=2,
                                  concurrency=1))
    assert nobody["succeeded"] == 0 and nobody["errors"] == {"ConnectError": 2}


def _cli():
    cli = typer.Typer()
    cli.command()(bench_serve_command)
    return cli


def test_cli_runs_both_workloads_and_writes_json(servers, tmp_path):
    (tmp_path / "system.txt").write_text(SYSTEM)
    (tmp_path / "questions.txt").write_text("\n".join(q.replace("\n", " ") for q in QUESTIONS))
    common = ["--url", servers["on"].url, "--system-prompt", str(tmp_path / "system.txt"), "--prompts",
              str(tmp_path / "questions.txt"), "--max-tokens", "4"]
    result = CliRunner().invoke(_cli(), [*common, "--workload", "multi-turn", "--conversations", "2", "--turns", "2",
                                         "--json", str(tmp_path / "chat.json")])
    assert result.exit_code == 0, result.output
    assert "multi-turn: 4/4 requests succeeded" in result.output and "hit rate" in result.output
    report = json.loads((tmp_path / "chat.json").read_text())
    assert [row["turn"] for row in report["per_turn"]] == [1, 2] and report["config"]["conversations"] == 2
    assert report["per_turn"][1]["cached_tokens"] > 0
    result = CliRunner().invoke(_cli(), [*common, "--workload", "shared-system", "-n", "3", "-c", "2"])
    assert result.exit_code == 0, result.output
    assert "shared-system: 3/3 requests succeeded" in result.output and "later / first" in result.output


def test_cli_runs_the_same_chats_on_llama_server_beside_ours(servers, tmp_path):
    from llama_server_standin import install

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "system.txt").write_text(SYSTEM)
    (tmp_path / "questions.txt").write_text("\n".join(q.replace("\n", " ") for q in QUESTIONS))
    result = CliRunner().invoke(_cli(), ["--url", servers["on"].url, "--system-prompt", str(tmp_path / "system.txt"),
                                         "--prompts", str(tmp_path / "questions.txt"), "--workload", "multi-turn",
                                         "--conversations",
                                         "2", "--turns", "2", "--max-tokens", "4", "--llama-server",
                                         install(tmp_path), "--peer-gguf", str(gguf), "--threads", "1",
                                         "--peer-context", "1024", "--json", str(tmp_path / "chat.json")])
    assert result.exit_code == 0, result.output
    assert "multi-turn: 4/4 requests succeeded" in result.output and "llama-server (" in result.output
    report = json.loads((tmp_path / "chat.json").read_text())
    peer = report["peers"]["llama-server"]
    assert peer["requests"] == peer["succeeded"] == 4 and peer["config"]["run_id"] != report["config"]["run_id"]
    command = " ".join(peer["config"]["command"])
    assert "--jinja" in command and "-np 2" in command and "-c 2048" in command and f"-m {gguf}" in command
    assert [row["turn"] for row in peer["per_turn"]] == [1, 2]
    assert all(row["cached_tokens"] is not None for row in peer["per_turn"])  # its usage's cached_tokens


@pytest.mark.parametrize("args, message", [
    (["--workload", "multi-turn", "--rate", "2"], "--rate does not apply to --workload multi-turn"),
    (["--workload", "shared-system", "--turns", "3"], "--turns does not apply"),
    (["--turns", "3"], "--turns does not apply to --workload completions"),
    (["--workload", "multi-turn", "--plot", "x.png"], "--plot does not apply"),
    (["--workload", "chat"], "use one of completions, multi-turn, shared-system"),
    (["--workload", "multi-turn", "--conversations", "0"], "conversations must be >= 1"),
    (["--workload", "edit", "--llama-server", "x"], "--llama-server does not apply to --workload edit"),
    (["--workload", "multi-turn", "--llama-server", "x"], "--llama-server needs the GGUF it serves"),
    (["--workload", "multi-turn", "--llama-server", "/nope/llama-server", "--peer-gguf", "/nope/m.gguf"],
     "not a .gguf file"),
])
def test_cli_refuses_options_a_workload_ignores(args, message):
    result = CliRunner().invoke(_cli(), ["--url", f"http://127.0.0.1:{free_port()}", *args])
    assert result.exit_code != 0 and message in " ".join(result.output.split()), result.output
