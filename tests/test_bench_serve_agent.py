"""`specdecode bench serve --workload agent`: the session loop in auto mode (the model's calls decide each turn,
tool results fed back as `tool` messages, the repository changed by write_file) and steered, the built-in tasks and
their checks (each fails on the untouched repository and passes on a right edit), the fair order (warm-up, rotation)
through bench_agent, the report's per-turn breakdown from given records, option checks; and the workload end to end
through the CLI against a live tiny server with llama-cpp-python's function calling and, where it is built,
llama-server as peers (127.0.0.1 only)."""

from __future__ import annotations

import contextlib
import json
import re

import pytest

from specdecode.bench import serve_agent
from specdecode.bench.agent_report import prompt_split, summarize, turn_rows
from specdecode.bench.agent_tasks import (TOOLS, AgentTask, Repository, builtin_tasks, check_task, invalid_call,
                                          safe_path)
from specdecode.bench.serve_agent import (LLAMA_SERVER, PEER, PLAIN, AgentBenchSettings, SessionRecord, TurnRecord,
                                          bench_agent, run_session, task_order)
from specdecode.errors import OptionError

TASK = AgentTask("tiny", "Add a comment to a.py.", {"a.py": "x = 1\n", "b.txt": "hello\n"},
                 check="assert read('a.py').startswith('#') and __import__('a').x == 1", kind="edit")
FIXED = "# one\nx = 1\n"


class AgentChat:
    """A model that acts as an agent in auto mode: lists, reads a.py, writes `content`, then answers; steered turns
    get the call they name."""

    def __init__(self, content: str = FIXED):
        self.content, self.seen = content, []

    def __call__(self, messages, tool_choice, record, max_tokens=None):
        self.seen.append((json.loads(json.dumps(messages)), tool_choice))
        record.latency_s, record.ttft_s, record.last_token_s, record.output_tokens = 1.0, 0.2, 0.8, 7
        done = sum(m["role"] == "tool" for m in messages)
        plan = [("list_files", {}), ("read_file", {"path": "a.py"}),
                ("write_file", {"path": "a.py", "content": self.content})]
        if tool_choice != "auto":
            name = tool_choice["function"]["name"]
            plan = [next(p for p in plan if p[0] == name)] * 3
        if done >= len(plan):
            record.text, record.finish_reason = "Done.", "stop"
            return
        name, args = plan[done]
        record.tool_calls = [{"id": f"call_{len(self.seen)}", "name": name, "arguments": json.dumps(args)}]
        record.finish_reason = "tool_calls"


def settings(**kw):
    return AgentBenchSettings(servers=[("ours", "http://127.0.0.1:1")], tasks=[TASK], **kw)


def test_an_auto_session_calls_tools_feeds_results_back_ends_on_text_and_is_checked():
    chat = AgentChat()
    session, records = run_session(chat, "ours", TASK, settings())
    assert [r.tool_choice for r in records] == ["auto"] * 4 and [c for _, c in chat.seen] == ["auto"] * 4
    assert all(r.ok and not r.invalid_calls for r in records) and records[-1].text == "Done."
    assert (session.ended, session.turns, session.completed, session.check) == ("answer", 4, True, "ok")
    assert session.calls_after_turn_1 and session.changed == ["a.py"]
    assert session.session_s >= 0 and all(r.idle_s >= 0 for r in records)
    last_messages = chat.seen[3][0]
    assert [m["role"] for m in last_messages] == ["system", "user"] + ["assistant", "tool"] * 3
    tool_results = [m["content"] for m in last_messages if m["role"] == "tool"]
    assert tool_results == ["a.py\nb.txt", "x = 1\n", "wrote 2 lines to a.py"]
    for assistant, tool in zip(last_messages[2::2], last_messages[3::2]):  # each result answers its call
        assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"]
    wrong, _ = run_session(AgentChat("x = 2\n"), "ours", TASK, settings())
    assert not wrong.completed and "AssertionError" in wrong.check


def test_steering_names_the_first_three_tools_and_tool_latency_is_idle_time():
    chat, slept = AgentChat(), []
    session, records = run_session(chat, "ours", TASK, settings(steer=True, tool_latency_s=0.25),
                                   sleep=slept.append)
    choices = [c for _, c in chat.seen]
    assert choices[:3] == [{"type": "function", "function": {"name": n}}
                           for n in ("list_files", "read_file", "write_file")] and choices[3] == "auto"
    assert [r.tool_choice for r in records] == ["list_files", "read_file", "write_file", "auto"]
    assert slept == [0.25] * 3 and session.completed  # after each turn of calls, not after the answer


def test_a_session_stops_at_a_failed_turn_and_at_a_call_cut_by_max_tokens():
    def failing(messages, tool_choice, record, max_tokens=None):
        raise RuntimeError("HTTP 500")

    session, [record] = run_session(failing, "ours", TASK, settings())
    assert not record.ok and "HTTP 500" in record.error and session.ended == "error" and not session.completed

    def cut(messages, tool_choice, record, max_tokens=None):
        record.tool_calls = [{"id": "c", "name": "list_files", "arguments": "{"}]
        record.finish_reason = "length"

    session, [record] = run_session(cut, "ours", TASK, settings())
    assert record.ok and session.ended == "length"
    assert record.invalid_calls == ["list_files: arguments are not JSON (Expecting property name enclosed in double "
                                    "quotes)"]


class FencedChat(AgentChat):
    """The same agent, its calls written as the peers return the default model's: a ```json block as content."""

    def __call__(self, messages, tool_choice, record, max_tokens=None):
        super().__call__(messages, tool_choice, record, max_tokens)
        for call in record.tool_calls:
            call = {"name": call["name"], "arguments": json.loads(call["arguments"])}
            record.text = f"```json\n{json.dumps(call, indent=2)}\n```"
        record.tool_calls, record.finish_reason = [], "stop"


def _without_ids(messages):
    text = json.dumps(messages)
    return json.loads(re.sub(r'"(tool_call_)?id": "[^"]*"', r'"\1id": "x"', text))


def test_the_client_reads_a_peers_fenced_call_and_goes_on_as_with_our_servers_calls():
    fenced, ours = FencedChat(), AgentChat()
    session, records = run_session(fenced, PEER, TASK, settings())
    assert (session.turns, session.ended, session.completed, session.client_parsed_calls) == (4, "answer", True, 3)
    assert [r.client_parsed_calls for r in records] == [1, 1, 1, 0] and records[0].server_text.startswith("```json")
    assert records[1].tool_calls[0]["name"] == "read_file" and not any(r.invalid_calls for r in records)
    turn_2 = fenced.seen[1][0][2]  # the assistant message of turn 1, sent back with turn 2
    assert turn_2["content"] == "" and turn_2["tool_calls"][0]["function"] == {"name": "list_files",
                                                                                 "arguments": "{}"}
    run_session(ours, "ours", TASK, settings())
    assert _without_ids([m for m, _ in fenced.seen]) == _without_ids([m for m, _ in ours.seen])  # the same history
    s = AgentBenchSettings(servers=[("ours", "u")], peer_gguf="x.gguf", tasks=[TASK])
    report = summarize([session], records, 1.0, s)
    peer = report["methods"][PEER]
    assert (peer["calls"], peer["valid_calls"], peer["client_parsed_calls"], peer["client_parsed_valid_calls"]) == \
        (0, 0, 3, 3)
    assert [r["client_parsed_calls"] for r in report["turns"]] == [1, 1, 1, 0]
    assert "our server's own parser" in report["config"]["client_reads_calls"]
    assert "as JSON values" in report["config"]["function_calling_arguments"]


def test_llamacpp_python_gets_the_calls_arguments_as_its_template_must_render_them():
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    from test_server_tools import QWEN25_TEMPLATE

    chat = AgentChat()
    run_session(chat, PEER, TASK, settings())
    history = chat.seen[-1][0]
    render = Jinja2ChatFormatter(QWEN25_TEMPLATE, eos_token="<|im_end|>", bos_token="")
    written = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'  # as the model does
    assert written in render(messages=serve_agent.as_template_takes(history), tools=TOOLS).prompt
    assert written not in render(messages=history, tools=TOOLS).prompt  # a string comes back quoted
    assert history[2]["tool_calls"][0]["function"]["arguments"] == "{}"  # the client's own history is unchanged


def test_our_answers_and_text_that_is_no_declared_call_are_never_read_as_calls():
    session, [record] = run_session(FencedChat(), "ours", TASK, settings())  # ours: tool_calls or nothing
    assert session.ended == "answer" and record.text.startswith("```json") and not record.tool_calls
    session, [record] = run_session(FencedChat(), PEER, TASK, settings(client_parses_calls=False))
    assert session.ended == "answer" and not record.tool_calls and record.client_parsed_calls == 0
    for text in ('```json\n{"name": "delete_file", "arguments": {"path": "a.py"}}\n```', '{"path": "a.py"}',
                 'Call it so: {"name": "read_file", "arguments": {"path": "a.py"}}'):
        def answer(messages, tool_choice, record, max_tokens=None, text=text):
            record.text, record.finish_reason = text, "stop"

        session, [record] = run_session(answer, LLAMA_SERVER, TASK, settings())
        assert (session.ended, record.text, record.tool_calls, record.server_text) == ("answer", text, [], None)


def test_the_cli_turns_the_client_reading_off_for_the_agent_workload_only(monkeypatch):
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    given = []

    def bench(s):
        given.append(s.client_parses_calls)
        return summarize([], [TurnRecord(PEER, "t", 1, "auto", ok=True, latency_s=1.0)], 1.0, s)

    monkeypatch.setattr(serve_agent, "bench_agent", bench)
    for flag in ([], ["--no-client-parses-calls"]):
        result = CliRunner().invoke(app, ["bench", "serve", "--workload", "agent", "--server", "ours=http://x", *flag])
        assert result.exit_code == 0, result.output
    assert given == [True, False]
    result = CliRunner().invoke(app, ["bench", "serve", "--workload", "edit", "--no-client-parses-calls"])
    assert "--no-client-parses-calls does not apply to --workload edit" in result.output


def test_speedups_over_sessions_of_equal_length():
    def session(method, task, turns, seconds):
        return SessionRecord(method, task, "edit", 0, turns=turns, session_s=seconds)

    def turn(method, task, decode_s):
        return TurnRecord(method, task, 1, "auto", ok=True, latency_s=decode_s, decode_tokens=10,
                          decode_time_s=decode_s)

    sessions = [session("ours", "a", 4, 10.0), session(PLAIN, "a", 4, 20.0), session(LLAMA_SERVER, "a", 4, 15.0),
                session("ours", "b", 4, 10.0), session(PLAIN, "b", 5, 30.0), session(LLAMA_SERVER, "b", 1, 1.0)]
    records = [turn("ours", "a", 1.0), turn(PLAIN, "a", 2.0), turn(LLAMA_SERVER, "a", 4.0),
               turn("ours", "b", 1.0), turn(PLAIN, "b", 8.0), turn(LLAMA_SERVER, "b", 0.1)]
    s = AgentBenchSettings(servers=[("ours", "u")], plain=True, peer_gguf="x.gguf", llama_server="",
                           function_calling=False, tasks=[TASK])
    report = summarize(sessions, records, 1.0, s)
    assert report["reference"] == PLAIN
    assert [report["methods"][m]["turns_equal_to_reference"] for m in s.methods] == [1, 2, 1]
    equal = report["speedups"]["ours"]["equal_turns"]
    assert equal[PLAIN] == {"tasks": 1, "session_time": pytest.approx(2.0), "decode": pytest.approx(2.0)}
    assert equal[LLAMA_SERVER] == {"tasks": 1, "session_time": pytest.approx(1.5), "decode": pytest.approx(4.0)}
    assert report["speedups"]["ours"]["session_time_vs_llama_server"] == pytest.approx(0.8)  # whole sessions kept
    assert report["speedups"][LLAMA_SERVER]["equal_turns"][PLAIN]["tasks"] == 1


def test_the_repository_answers_like_a_real_one_and_stays_inside():
    repo = Repository(TASK.files)
    assert repo.run("read_file", '{"path": "nope.py"}').startswith("error: no file 'nope.py'")
    assert repo.run("write_file", '{"path": "c.py", "content": "a\\nb"}') == "wrote 2 lines to c.py"
    assert repo.run("list_files", "{}") == "a.py\nb.txt\nc.py"
    assert repo.run("write_file", '{"path": "../x.py", "content": ""}').startswith("error: '../x.py' is not a path")
    assert repo.run("read_file", '{"path": "/etc/passwd"}').startswith("error: '/etc/passwd' is not a path")
    assert repo.run("read_file", "{'path'}").startswith("error: the arguments are not JSON")
    assert TASK.files == {"a.py": "x = 1\n", "b.txt": "hello\n"}  # a session never changes the task itself
    assert safe_path("./src/a.py") == "src/a.py" and safe_path("a/../../b") is None and safe_path("") is None


def test_invalid_calls_are_named():
    assert invalid_call({"name": "read_file", "arguments": '{"path": "a.py"}'}) is None
    assert invalid_call({"name": "rm", "arguments": "{}"}) == "rm: no such tool"
    assert "'path' is a required property" in invalid_call({"name": "read_file", "arguments": "{}"})
    assert "Additional properties" in invalid_call({"name": "list_files", "arguments": '{"x": 1}'})


# Right edits of each built-in task, written as a user would make them.
LEAP_TEST = ("\n\nfrom dates import is_leap\n\n\ndef test_is_leap():\n    assert is_leap(2000) and is_leap(2024)\n"
             "    assert not is_leap(1900) and not is_leap(2023)\n")
SOLUTIONS = {
    "docstrings": ("stats.py", lambda t: re.sub(r"(def (\w+)\(.*\):\n)", r'\1    """The \2."""\n', t)),
    "rename": ("inventory.py", lambda t: t.replace("add_item", "add_stock")),
    "type-hints": ("textutils.py", lambda t: t.replace("def words(text)", "def words(text: str) -> list")
                   .replace("def word_counts(text)", "def word_counts(text: str) -> dict")
                   .replace('def truncate(text, width=40, suffix="...")',
                            'def truncate(text: str, width: int = 40, suffix: str = "...") -> str')
                   .replace("def slugify(text)", "def slugify(text: str) -> str")),
    "add-test": ("test_dates.py", lambda t: t + LEAP_TEST),
    "fix-discount": ("cart.py", lambda t: t.replace("total - percent", "total * (100 - percent) / 100")),
    "fix-chunks": ("listutils.py", lambda t: t.replace("len(items) - size", "len(items)")),
    "add-function": ("mathutils.py", lambda t: t + "\n\ndef clamp(value, low, high):\n"
                                                   "    return max(low, min(value, high))\n"),
    "validate": ("bank.py", lambda t: t.replace("        self.balance -= amount",
                                                "        if amount < 0 or amount > self.balance:\n"
                                                "            raise ValueError(amount)\n"
                                                "        self.balance -= amount")),
}


def test_the_builtin_tasks_are_coding_tasks_whose_checks_tell_done_from_not_done():
    tasks = builtin_tasks()
    assert len(tasks) >= 8 and len({t.id for t in tasks}) == len(tasks)
    kinds = {t.kind for t in tasks}
    assert {"edit", "rename", "add a test", "fix a bug from a failing test"} <= kinds, kinds
    assert {t.id for t in tasks} == set(SOLUTIONS)
    for task in tasks:
        path, edit = SOLUTIONS[task.id]
        assert path in task.files and path in task.instruction
        before = check_task(task, task.files)
        assert not before.passed and before.changed == [], (task.id, before)
        after = check_task(task, {**task.files, path: edit(task.files[path])})
        assert after.passed and after.changed == [path], (task.id, after.detail)
        broken = check_task(task, {**task.files, path: edit(task.files[path]) + "\ndef (:\n"})
        assert not broken.passed and "SyntaxError" in broken.detail, (task.id, broken.detail)


def test_a_test_that_cannot_fail_does_not_complete_the_add_a_test_task():
    task = next(t for t in builtin_tasks() if t.id == "add-test")
    weak = task.files["test_dates.py"] + "\n\nfrom dates import is_leap\n\n\ndef test_is_leap():\n" \
                                         "    assert is_leap(2024)\n"
    result = check_task(task, {**task.files, "test_dates.py": weak})
    assert not result.passed and "passes on a wrong is_leap" in result.detail


def test_bench_agent_warms_every_method_then_rotates_the_order_task_by_task(monkeypatch):
    calls = []

    def chat_of(name):
        agent = AgentChat()

        def chat(messages, tool_choice, record, max_tokens=None):
            calls.append((name, messages[1]["content"], max_tokens))
            agent(messages, tool_choice, record, max_tokens)
        return chat

    names = ["a", "b", "c"]

    @contextlib.contextmanager
    def started(s):
        yield {n: chat_of(n) for n in s.methods}

    monkeypatch.setattr(serve_agent, "started_methods", started)
    tasks = [AgentTask(f"t{i}", f"task {i}", TASK.files, TASK.check) for i in range(4)]
    report = bench_agent(AgentBenchSettings(servers=[(n, "u") for n in names], tasks=tasks))
    warm, rest = calls[:3], calls[3:]
    assert [(n, m) for n, _, m in warm] == [("a", 1), ("b", 1), ("c", 1)]
    firsts = [(n, text) for n, text, _ in rest if text.startswith("task")][::4]  # 4 turns a session
    assert firsts == [("a", "task 0"), ("b", "task 0"), ("c", "task 0"), ("b", "task 1"), ("c", "task 1"),
                      ("a", "task 1"), ("c", "task 2"), ("a", "task 2"), ("b", "task 2"), ("a", "task 3"),
                      ("b", "task 3"), ("c", "task 3")]
    assert "rotated by one each task" in report["config"]["order"] and "untimed" in report["config"]["order"]
    assert [s["position"] for s in report["sessions"] if s["method"] == "a"] == [0, 2, 1, 0]
    for name in names:
        t = report["methods"][name]
        assert (t["tasks"], t["completed"], t["calls_after_turn_1"], t["turns"]) == (4, 4, 4, 16)
        assert t["valid_calls"] == t["calls"] == 12 and t["ended"] == {"answer": 4}
    assert task_order(names, 5, rotate=False) == names


def test_the_report_splits_each_turn_from_given_records():
    def rec(method, turn, text, latency, decode, cached=None, spec=None, timings=None):
        return TurnRecord(method, "t", turn, "auto", ok=True, text=text, output_tokens=11, latency_s=latency,
                          decode_tokens=10 if decode else None, decode_time_s=decode, prompt_tokens=100,
                          cached_tokens=cached, idle_s=0.5 * (turn > 1), speculative=spec, timings=timings)

    spec = {"forced_tokens": 4, "proposed_tokens": 9, "accepted_tokens": 6}
    records = [rec("ours", 1, "a", 1.0, 0.5, 10, spec), rec(PLAIN, 1, "a", 2.0, 1.0, 10, {"forced_tokens": 4}),
               rec(PEER, 1, "z", 4.0, None), rec(LLAMA_SERVER, 1, "y", 3.0, 1.0, 20, None,
                                                 {"draft_n": 0, "draft_n_accepted": 0}),
               rec("ours", 2, "b", 1.0, 0.5, 90, spec), rec(PLAIN, 2, "c", 2.0, 1.0, 80, {"forced_tokens": 4}),
               rec(PEER, 2, "z", 4.0, None), rec(LLAMA_SERVER, 2, "y", 3.0, 1.0, 95)]
    s = AgentBenchSettings(servers=[("ours", "u")], plain=True, peer_gguf="x.gguf", llama_server="", tasks=[TASK])
    report = summarize([], records, 10.0, s)
    assert report["config"]["methods"] == ["ours", PLAIN, LLAMA_SERVER, PEER]
    assert "shares the prefix cache of 'ours'" in report["config"]["order"]
    assert report["same_text"] == {"reference": PLAIN, "checked": 2, "differences": ["ours t turn 2"]}
    ours = report["methods"]["ours"]
    assert ours["decode_tokens_per_s"] == pytest.approx(20.0) and ours["idle_s"] == 0.5
    assert (ours["cold_tokens"], ours["cached_tokens"], ours["forced_tokens"], ours["drafted_tokens"],
            ours["kept_tokens"]) == (100, 100, 8, 18, 12)
    assert report["methods"][PEER]["cold_tokens"] is None and report["methods"][PEER]["prompt_tokens"] == 200
    assert report["methods"][LLAMA_SERVER]["drafted_tokens"] == 0
    rows = {(r["turn"], r["method"]): r for r in turn_rows(records, s.methods)}
    assert (rows[2, "ours"]["cold_tokens"], rows[2, "ours"]["cached_tokens"]) == (10, 90)
    assert rows[2, LLAMA_SERVER]["cached_tokens"] == 95 and rows[1, PEER]["median_decode_tokens_per_s"] is None
    assert prompt_split([rec(PEER, 1, "", 1.0, None)])["cold_tokens"] is None
    speed = report["speedups"]["ours"]
    assert speed["decode_vs_plain"] == pytest.approx(2.0)
    assert speed["session_time_vs_function_calling"] is None  # no sessions given: no session time to compare


@pytest.mark.parametrize("kw,message", [
    (dict(servers=[]), "at least one server"),
    (dict(servers=[("plain", "u")], plain=True), "must be distinct"),
    (dict(servers=[("llama-server", "u")]), "must be distinct"),
    (dict(servers=[("a", "u"), ("a", "v")]), "must be distinct"),
    (dict(servers=[("a", "u")], max_turns=3, steer=True), "max_turns must be >= 4"),
    (dict(servers=[("a", "u")], max_turns=0), "max_turns must be >= 1"),
    (dict(servers=[("a", "u")], tool_latency_s=-1), "tool latency must be >= 0"),
    (dict(servers=[("a", "u")], llama_server="/bin/llama-server"), "give --peer-gguf"),
])
def test_bad_settings(kw, message):
    with pytest.raises(OptionError, match=message):
        AgentBenchSettings(**kw)


def test_a_server_named_plain_is_the_reference():
    s = AgentBenchSettings(servers=[("default", "u"), ("plain", "v")])
    assert s.methods == ["default", "plain"] and len(s.tasks) >= 8


# ------------------------------------------------------------------------ end to end, live tiny servers

TINY_TASK = {"id": "comment", "kind": "edit", "instruction": "Add a comment line at the top of a.py.",
             "files": {"a.py": "x = 1\n", "b.txt": "hello\n"},
             "check": "assert read('a.py').startswith('#') and __import__('a').x == 1"}


def agent_script(prompt: str) -> str:
    """What a scripted tiny model answers at each step of TINY_TASK: list, read, write, then a sentence."""
    from scripted_models import call

    steps = [call("list_files", {}), call("read_file", {"path": "a.py"}),
             call("write_file", {"path": "a.py", "content": "# one\nx = 1\n"}), "Done."]
    return steps[min(prompt.count("<tool_response>"), len(steps) - 1)]


@pytest.fixture(scope="module")
def tool_server(tokenizer):
    """A live tiny server (Qwen2.5's chat template, 2048 positions) on models scripted to do TINY_TASK in auto
    mode: their own tokens start each call."""
    from scripted_models import scripted_pair, tool_tokenizer
    from test_server_helpers import one_torch_thread  # noqa: F401
    from test_server_helpers import serve

    tok = tool_tokenizer(tokenizer)
    srv = serve(scripted_pair(tok, agent_script), tok, k=3, max_tokens_limit=400, request_timeout=120)
    yield srv
    srv.stop()


def _run_cli(args, tmp_path):
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    tasks, report_path = tmp_path / "tasks.jsonl", tmp_path / "agent.json"
    tasks.write_text(json.dumps(TINY_TASK) + "\n")
    result = CliRunner().invoke(app, ["bench", "serve", "--workload", "agent", "--prompts", str(tasks), *args,
                                      "--json", str(report_path)])
    assert result.exit_code == 0, result.output
    return result.output, json.loads(report_path.read_text())


def test_the_workload_end_to_end_in_auto_mode_against_a_live_server_and_llamacpp_function_calling(
        tool_server, smol_path, tmp_path):
    output, report = _run_cli(["--server", f"ours={tool_server.url}", "--plain", "--peer-gguf", str(smol_path),
                               "--threads", "1", "--peer-context", "4096", "--max-tokens", "200"], tmp_path)
    assert "per method" in output and "vs plain" in output and "prefill cold" in output and "order:" in output
    assert report["config"]["methods"] == ["ours", PLAIN, PEER] and report["config"]["tool_choice"] == "auto"
    assert report["config"]["tasks"] == ["comment"] and not report["errors"], report["errors"]
    for method in ("ours", PLAIN):  # the scripted model did the task through the tools, in auto mode
        totals = report["methods"][method]
        assert (totals["completed"], totals["calls_after_turn_1"], totals["turns"]) == (1, 1, 4), (method, totals)
        assert totals["valid_calls"] == totals["calls"] == 3 and totals["ended"] == {"answer": 1}
        assert totals["decode_tokens_per_s"] > 0 and totals["session_s"] > 0
    records = [r for r in report["records"] if r["method"] == "ours"]
    assert [[c["name"] for c in r["tool_calls"]] for r in records] == [["list_files"], ["read_file"],
                                                                         ["write_file"], []]
    # timed from the provenance chunks, one per token, however the call's text was streamed
    assert all(r["decode_tokens"] == r["output_tokens"] - 1 for r in records if r["output_tokens"] > 1)
    assert report["same_text"] == {"reference": PLAIN, "checked": 4, "differences": []}  # greedy is exact
    # the warm-up cached the system prompt and tools, every later turn its own history; drafts were proposed
    rows = [r for r in report["turns"] if r["method"] == "ours"]
    assert all(r["cached_tokens"] > 0 for r in rows) and rows[1]["cached_tokens"] > rows[0]["cached_tokens"]
    assert report["methods"]["ours"]["drafted_tokens"] > 0 and report["methods"][PLAIN]["drafted_tokens"] == 0
    peer = report["methods"][PEER]  # SmolLM2 through llama-cpp-python: it ran, whatever it answered
    assert peer["succeeded"] >= 1 and peer["output_tokens"] > 0 and peer["cold_tokens"] is None


def test_the_workload_against_llama_server(tool_server, smol_path, tmp_path):
    from specdecode.bench.llama_server import default_binary

    if not default_binary().is_file():
        pytest.skip(f"llama-server is not built at {default_binary()}: bash scripts/build_llama_server.sh")
    output, report = _run_cli(["--server", f"ours={tool_server.url}", "--peer-gguf", str(smol_path),
                               "--llama-server", str(default_binary()), "--no-function-calling", "--threads", "1",
                               "--peer-context", "2048", "--turns", "1", "--max-tokens", "8"], tmp_path)
    assert report["config"]["methods"] == ["ours", LLAMA_SERVER] and not report["errors"], report["errors"]
    assert "--jinja" in report["config"]["commands"][LLAMA_SERVER]
    server = [r for r in report["records"] if r["method"] == LLAMA_SERVER]
    assert server and all(r["ok"] and r["output_tokens"] > 0 for r in server)
    assert server[0]["cached_tokens"] > 0  # its prompt cache kept the warm-up's system prompt and tools
    assert report["methods"][LLAMA_SERVER]["decode_tokens_per_s"] is not None  # its own timings


def test_agent_tasks_from_a_file_and_bad_files(tmp_path):
    from specdecode.bench.agent_tasks import load_tasks

    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(TINY_TASK) + "\n\n" + json.dumps({"instruction": "x", "files": {}}) + "\n")
    [task, other] = load_tasks(str(path))
    assert (task.id, task.kind, task.files, other.id, other.check) == ("comment", "edit", TINY_TASK["files"],
                                                                       "task-2", "")
    assert check_task(task, {**task.files, "a.py": "# c\nx = 1\n"}).passed
    for line, message in [("{", "line 1: not valid JSON"), ('{"files": {}}', 'non-empty string "instruction"'),
                          ('{"instruction": "x", "files": {"a": 1}}', '"files" must be an object'),
                          ('{"instruction": "x", "files": {"../a": ""}}', "inside the repository"),
                          ('{"instruction": "x", "files": {}, "check": 3}', '"check" (Python)')]:
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=re.escape(message)):
            load_tasks(str(path))
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no tasks"):
        load_tasks(str(path))
