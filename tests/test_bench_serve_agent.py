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
