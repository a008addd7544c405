"""`specdecode bench serve --workload agent`: the session loop (steered list/read/write turns, tool results fed back
as `tool` messages, the repository changed by write_file), the call validity check, the same-text check and the
speedups from given records, option checks; and the workload end to end through the OpenAI client against live
tiny servers with tool calling (127.0.0.1 only), with llama-cpp-python's function calling as the peer."""

from __future__ import annotations

import json

import pytest

from specdecode.bench.serve_agent import (PEER, PLAIN, AgentBenchSettings, AgentTask, Repository, TurnRecord,
                                          builtin_tasks, invalid_call, run_session, same_text, speedups,
                                          summarize)
from specdecode.errors import OptionError

TASK = AgentTask("tiny", "Add a comment to a.py.", {"a.py": "x = 1\n", "b.txt": "hello\n"})


class ScriptedChat:
    """Answers each steered turn with the call it names (arguments from `args`), and "auto" with text."""

    def __init__(self, args: dict, text: str = "done"):
        self.args, self.text, self.seen = args, text, []

    def __call__(self, messages, tool_choice, record):
        self.seen.append((json.loads(json.dumps(messages)), tool_choice))
        record.latency_s, record.ttft_s, record.last_token_s, record.output_tokens = 1.0, 0.2, 0.8, 7
        if tool_choice == "auto":
            record.text, record.finish_reason = self.text, "stop"
            return
        name = tool_choice["function"]["name"]
        record.tool_calls = [{"id": f"call_{len(self.seen)}", "name": name, "arguments": json.dumps(self.args[name])}]
        record.finish_reason = "tool_calls"


def settings(**kw):
    return AgentBenchSettings(servers=[("ours", "http://127.0.0.1:1")], tasks=[TASK], **kw)


def test_a_session_runs_the_steered_turns_feeds_tool_results_back_and_ends_on_text():
    chat = ScriptedChat({"list_files": {}, "read_file": {"path": "a.py"},
                         "write_file": {"path": "a.py", "content": "# one\nx = 1\n"}})
    records = run_session(chat, "ours", TASK, settings())
    assert [r.tool_choice for r in records] == ["list_files", "read_file", "write_file", "auto"]
    assert all(r.ok and not r.invalid_calls for r in records) and records[-1].text == "done"
    choices = [c for _, c in chat.seen]
    assert choices[:3] == [{"type": "function", "function": {"name": n}}
                           for n in ("list_files", "read_file", "write_file")] and choices[3] == "auto"
    last_messages = chat.seen[3][0]
    assert [m["role"] for m in last_messages] == ["system", "user"] + ["assistant", "tool"] * 3
    tool_results = [m["content"] for m in last_messages if m["role"] == "tool"]
    assert tool_results == ["a.py\nb.txt", "x = 1\n", "wrote 2 lines to a.py"]
    for assistant, tool in zip(last_messages[2::2], last_messages[3::2]):  # each result answers its call
        assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"]


def test_a_session_stops_at_a_failed_turn_and_at_a_call_cut_by_max_tokens():
    def failing(messages, tool_choice, record):
        raise RuntimeError("HTTP 500")

    [record] = run_session(failing, "ours", TASK, settings())
    assert not record.ok and "HTTP 500" in record.error

    def cut(messages, tool_choice, record):
        record.tool_calls = [{"id": "c", "name": "list_files", "arguments": "{"}]
        record.finish_reason = "length"

    [record] = run_session(cut, "ours", TASK, settings())
    assert record.ok and record.invalid_calls == ["list_files: arguments are not JSON (Expecting property name "
                                                  "enclosed in double quotes)"]


def test_the_repository_answers_like_a_real_one():
    repo = Repository(TASK.files)
    assert repo.run("read_file", '{"path": "nope.py"}').startswith("error: no file 'nope.py'")
    assert repo.run("write_file", '{"path": "c.py", "content": "a\\nb"}') == "wrote 2 lines to c.py"
    assert repo.run("list_files", "{}") == "a.py\nb.txt\nc.py"
    assert TASK.files == {"a.py": "x = 1\n", "b.txt": "hello\n"}  # a session never changes the task itself


def test_invalid_calls_are_named():
    assert invalid_call({"name": "read_file", "arguments": '{"path": "a.py"}'}) is None
    assert invalid_call({"name": "rm", "arguments": "{}"}) == "rm: no such tool"
    assert "'path' is a required property" in invalid_call({"name": "read_file", "arguments": "{}"})
    assert "Additional properties" in invalid_call({"name": "list_files", "arguments": '{"x": 1}'})


def test_same_text_and_speedups_from_given_records():
    def rec(method, turn, text, tokens, latency, decode):
        return TurnRecord(method, "t", turn, "auto", ok=True, text=text, output_tokens=tokens, latency_s=latency,
                          ttft_s=0.1 if decode else None, last_token_s=0.1 + decode if decode else None)

    records = [rec("ours", 1, "a", 11, 1.0, 0.5), rec(PLAIN, 1, "a", 11, 2.0, 1.0), rec(PEER, 1, "z", 11, 4.0, None),
               rec("ours", 2, "b", 11, 1.0, 0.5), rec(PLAIN, 2, "c", 11, 2.0, 1.0), rec(PEER, 2, "z", 11, 4.0, None)]
    report = summarize(records, 10.0, AgentBenchSettings(servers=[("ours", "u")], peer_gguf="x.gguf", tasks=[TASK]))
    assert report["same_text"] == {"reference": PLAIN, "checked": 2, "differences": ["ours t turn 2"]}
    assert report["methods"]["ours"]["decode_tokens_per_s"] == pytest.approx(20.0)
    s = report["speedups"]["ours"]
    assert s["decode_vs_plain"] == pytest.approx(2.0) and s["session_time_vs_peer"] == pytest.approx(4.0)
    assert speedups({"x": {"decode_tokens_per_s": None, "end_to_end_s": 1.0, "tokens_per_s": 1.0}})["x"] == \
        {"decode_vs_plain": None, "session_time_vs_peer": None, "tokens_per_s_vs_peer": None}


def test_the_builtin_tasks_are_coding_edits():
    tasks = builtin_tasks()
    assert len(tasks) >= 3
    for task in tasks:
        assert any(name.endswith(".py") for name in task.files) and "write_file" in task.instruction


@pytest.mark.parametrize("kw,message", [
    (dict(servers=[]), "at least one server"),
    (dict(servers=[("plain", "u")]), "must be distinct"),
    (dict(servers=[("a", "u"), ("a", "v")]), "must be distinct"),
    (dict(servers=[("a", "u")], max_turns=3), "max_turns must be >= 4"),
])
def test_bad_settings(kw, message):
    with pytest.raises(OptionError, match=message):
        AgentBenchSettings(**kw)


# ------------------------------------------------------------------------ end to end, live tiny servers

@pytest.fixture(scope="module")
def tool_server(tiny_pair, tokenizer):
    """A live tiny server whose tokenizer has Qwen2.5's chat template (tools and tool messages) and 2048 positions
    (the template's system prompt with three tools is ~1000 tiny tokens)."""
    import copy

    from test_server_helpers import one_torch_thread  # noqa: F401
    from test_server_helpers import serve
    from test_server_tools import QWEN25_TEMPLATE

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN25_TEMPLATE.strip()
    pair = copy.deepcopy(tiny_pair)
    for model in pair:
        model.config.max_position_embeddings = 2048
    srv = serve(pair, tok, k=3, max_tokens_limit=400, request_timeout=120)
    yield srv
    srv.stop()


def test_the_workload_end_to_end_against_a_live_server_and_llamacpp_function_calling(tool_server, smol_path,
                                                                                      tmp_path):
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    report_path = tmp_path / "agent.json"
    # the CLI reads built-in tasks only; a one-task run keeps the tiny context
    result = CliRunner().invoke(app, ["bench", "serve", "--workload", "agent", "--server", f"ours={tool_server.url}",
                                      "--peer-gguf", str(smol_path), "--threads", "1", "--nb-prompts", "1",
                                      "--turns", "4", "--max-tokens", "80", "--json", str(report_path)])
    assert result.exit_code == 0, result.output
    assert "per method" in result.output and "decode vs plain" in result.output
    report = json.loads(report_path.read_text())
    assert report["config"]["methods"] == ["ours", PLAIN, PEER]
    assert not report["errors"], report["errors"]
    for method in ("ours", PLAIN, PEER):
        totals = report["methods"][method]
        assert totals["succeeded"] >= 1 and totals["calls"] >= 1 and totals["output_tokens"] > 0
    # our grammar allows only valid calls; a call cut at max_tokens is the only kind that can fail the schema
    for r in report["records"]:
        if r["method"] != PEER and r["finish_reason"] != "length":
            assert not r["invalid_calls"], r
    # greedy decoding is exact: speculation changed no text and no call
    same = report["same_text"]
    assert same["checked"] >= 1 and same["differences"] == []
    first = [r for r in report["records"] if r["method"] == "ours"][0]
    assert first["tool_choice"] == "list_files" and first["tool_calls"][0]["name"] == "list_files"
    assert first["speculative"] is not None  # our server's statistics reached the client

