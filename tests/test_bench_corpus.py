"""`specdecode bench serve --workload corpus`: the modules picked by the rule (real, 40-400 lines, the same on every
call, never bisect.py), each edit kind's task and its check (a right edit accepted, a wrong one refused), the six
chat kinds (the follow-up quotes the first answer), the statistics on made-up timings, and the command end to end on
a fresh `specdecode serve` of the tiny models started by the bench each round, beside llama-server stand-ins
(tests/llama_server_standin.py) and, where scripts/build_llama_server.sh has built it, the real llama-server."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from specdecode.bench import corpus
from specdecode.bench.corpus import EDIT_KINDS, Module, answer_code, pick_tasks
from specdecode.bench.corpus_chat import CHAT_KINDS, chat_tasks
from specdecode.bench.corpus_run import CorpusSettings, markdown_table, overall, summarize

SOURCE = '''"""A module of three functions."""
LIMIT = 8


def _helper(x):
    return x * LIMIT


def unused(y):
    return y + 1


def main(values):
    total = _helper(values[0]) + _helper(values[1])
    return total if total < LIMIT else LIMIT
'''


def _module(text: str = SOURCE) -> Module:
    return Module("stdlib", "example.py", "/nowhere/example.py", text)


def _task(kind: str, text: str = SOURCE):
    return corpus.TASKS[kind](_module(text), ast.parse(text))


# ------------------------------------------------------------------------------------------------ the modules
def test_the_corpus_is_real_modules_picked_by_a_rule_the_same_on_every_call():
    tasks = pick_tasks(12)
    assert [t.kind for t in tasks] == [EDIT_KINDS[i % len(EDIT_KINDS)] for i in range(12)]
    paths = [Path(t.module.path) for t in tasks]
    assert len(set(paths)) == 12 and all(p.is_file() and p.suffix == ".py" for p in paths)
    for task in tasks:
        assert task.module.text == Path(task.module.path).read_text(encoding="utf-8")  # read now, not copied
        assert 40 <= len(task.module.text.splitlines()) <= 400, task.module.name
        assert "specdecode" not in Path(task.module.path).parts and Path(task.module.path).name != "bisect.py"
        # the whole edited file fits the answer's 2048 tokens
        assert len(task.module.text) * corpus.GROWTH / corpus.CHARS_PER_TOKEN <= 2048
    assert "stdlib" in {t.module.root for t in tasks}
    assert [(t.kind, t.module.path, t.ask) for t in pick_tasks(12)] == [(t.kind, t.module.path, t.ask) for t in tasks]
    only = pick_tasks(3, ("delete",))
    assert [t.kind for t in only] == ["delete"] * 3
    with pytest.raises(ValueError, match="unknown edit kind"):
        pick_tasks(1, ("poetry",))


# -------------------------------------------------------------------------------------------- the edit kinds
def test_each_kind_is_derived_from_the_modules_ast():
    rename, hints, docs, delete, constant = (_task(kind) for kind in EDIT_KINDS)
    assert rename.details == {"old": "_helper", "new": "_helper_impl", "calls": 2}
    assert "`_helper` to `_helper_impl`" in rename.ask
    assert delete.details["function"] == "unused"  # the first function nothing in the module names
    assert (constant.details["constant"], constant.details["old"], constant.details["new"]) == ("LIMIT", 8, 16)
    assert constant.details["uses"] == 3 and "from 8 to 16" in constant.ask
    assert hints.details == {"lacking": 3} and docs.details == {"lacking": 3}
    messages = rename.messages()
    assert messages[0]["role"] == "system" and SOURCE in messages[1]["content"]
    # no task where the module does not admit it
    bare = '"""Nothing to do."""\n\n\ndef f(x: int) -> int:\n    """Doc."""\n    return x\n'
    assert all(_task(kind, bare) is None for kind in ("rename", "type hints", "docstrings", "constant"))


class _Annotate(ast.NodeTransformer):
    """Every signature annotated with `object` (a method's first argument left bare), but the function named
    `skip`."""

    def __init__(self, skip: str | None = None):
        self.skip, self.methods = skip, set()

    def visit_ClassDef(self, node):
        self.methods |= {id(n) for n in node.body}
        return self.generic_visit(node)

    def visit_FunctionDef(self, node):
        if node.name != self.skip:
            args = [*node.args.posonlyargs, *node.args.args]
            static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
            for i, a in enumerate([*args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]):
                if a is not None and a.annotation is None and not (i == 0 and id(node) in self.methods and not static):
                    a.annotation = ast.Name("object")
            node.returns = node.returns or ast.Constant(None)
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef


class _Document(ast.NodeTransformer):
    def __init__(self, skip: str | None = None):
        self.skip = skip

    def visit_FunctionDef(self, node):
        if node.name != self.skip and ast.get_docstring(node, clean=False) is None:
            node.body.insert(0, ast.Expr(ast.Constant("What it does.")))
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef


def _fenced(code: str) -> str:
    return f"Here is the updated file:\n\n```python\n{code}\n```\n\nI changed only what you asked."


def _edits(task) -> tuple[str, str]:
    """A right answer and a wrong one to a task (code made from the module's AST: comments do not count)."""
    tree = lambda: ast.parse(task.module.text)  # noqa: E731
    d = task.details
    if task.kind == "rename":
        wrong = tree()
        for node in wrong.body:  # the definition renamed, its calls left as they were
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == d["old"]:
                node.name = d["new"]
        return ast.unparse(corpus._rename(tree(), d["old"], d["new"])), ast.unparse(wrong)
    if task.kind == "constant":
        right, wrong = tree(), tree()
        for t, value in ((right, d["new"]), (wrong, corpus._new_value(d["new"]))):
            for node in t.body:
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == d["constant"]:
                    node.value = ast.Constant(value)
        return ast.unparse(right), ast.unparse(wrong)
    if task.kind == "delete":
        wrong = tree()
        for node in wrong.body:  # emptied, not deleted
            if getattr(node, "name", None) == d["function"]:
                node.body = [ast.Pass()]
        return ast.unparse(task.expected(tree())), ast.unparse(wrong)
    hints = task.kind == "type hints"
    make = _Annotate if hints else _Document
    missed = (corpus._lacking_hints if hints else corpus._lacking_docstrings)(tree())[0]
    return ast.unparse(make().visit(tree())), ast.unparse(make(skip=missed).visit(tree()))  # one function missed


@pytest.mark.parametrize("kind", EDIT_KINDS)
def test_each_kinds_check_accepts_the_edit_and_refuses_others(kind):
    for task in (_task(kind), pick_tasks(1, (kind,))[0]):  # the example, and the corpus's first module of the kind
        right, wrong = _edits(task)
        assert task.check(_fenced(right)) == {"parses": True, "as_asked": True, "why": ""}, (task.module.name, right)
        assert task.check(right)["as_asked"]  # an answer without a fence: the whole answer is the code
        refused = task.check(_fenced(wrong))
        assert refused["parses"] and not refused["as_asked"] and refused["why"], (task.module.name, refused)
        assert not task.check(_fenced(task.module.text))["as_asked"]  # the file sent back unchanged
        truncated = task.check("```python\n" + task.module.text[: len(task.module.text) // 2].rsplit("\n", 3)[0])
        assert not truncated["as_asked"]  # an answer cut short (max_tokens) is not the edit


def test_the_code_of_an_answer_is_its_longest_fenced_block():
    assert answer_code("```\nx = 1\n```\nthen\n```python\ny = 2\nz = 3\n```") == "y = 2\nz = 3\n"
    assert answer_code("x = 1\n") == "x = 1\n"
    assert answer_code("```python\nx = 1\n") == "x = 1\n\n"  # cut short: no closing fence


# -------------------------------------------------------------------------------------------- the chat kinds
def test_the_chat_kinds_and_the_follow_up_quoting_its_first_answer():
    tasks = chat_tasks()
    assert CHAT_KINDS == ("factual", "explanation", "code", "translation", "summary", "follow-up")
    assert [k for k in CHAT_KINDS] == list(dict.fromkeys(t.kind for t in tasks))
    follow = next(t for t in tasks if t.kind == "follow-up")
    assert len(follow.turns) == 2 and follow.turn_kind(0) == "follow-up: first turn"
    assert follow.turn_kind(1) == "follow-up"
    first, second = follow.turns[0]([]), follow.turns[1](["THE FIRST ANSWER"])
    assert second[:2] == [first[0], {"role": "assistant", "content": "THE FIRST ANSWER"}]
    assert second[2]["role"] == "user" and second[2]["content"] != first[0]["content"]
    summaries = [t.turns[0]([])[0]["content"] for t in tasks if t.kind == "summary"]
    assert summaries and all(len(text) > 1500 for text in summaries)  # a long text, read from the stdlib now
    translations = [t for t in tasks if t.kind == "translation"]
    assert len(translations) == 2 and all("Translate" in t.turns[0]([])[0]["content"] for t in translations)
    assert [t.kind for t in chat_tasks(("code",))] == ["code", "code"]
    with pytest.raises(ValueError, match="unknown chat kind"):
        chat_tasks(("poetry",))
    assert CorpusSettings(url="x", think_s=0).passes() == [("back to back", 0.0)]
    assert [name for name, _ in CorpusSettings(url="x").passes()] == ["back to back", "think 2 s"]
    with pytest.raises(ValueError, match="temperature must be 0"):
        CorpusSettings(url="x", temperature=0.7)
    with pytest.raises(ValueError, match="nothing to send"):
        CorpusSettings(url="x", modules=0, chat_kinds=())


# ------------------------------------------------------------------------------------------------ statistics
def _rows(kind, server, seconds, ttft=0.5, failed_round=None):
    return [{"kind": kind, "server": server, "round": r + 1, "ok": r + 1 != failed_round,
             "seconds": None if r + 1 == failed_round else s, "ttft_s": ttft, "output_tokens": 100}
            for r, s in enumerate(seconds)]


def test_the_statistics_medians_the_best_peer_and_the_spread_of_our_ratio():
    servers = ["ours", "llama-server", "llama-server ngram-mod", "llama-server ngram-cache"]
    rows = (_rows("edit: rename", "ours", [10, 12, 11], ttft=0.4) + _rows("edit: rename", "llama-server", [20] * 3)
            + _rows("edit: rename", "llama-server ngram-mod", [15, 18, 12], ttft=0.3)
            # the fastest peer, but one of its rounds failed and another is missing: its figure is its one round
            + _rows("edit: rename", "llama-server ngram-cache", [13, 1], failed_round=2)
            + _rows("chat: factual (back to back)", "ours", [2, 2, 2]) * 2
            + _rows("chat: factual (back to back)", "llama-server", [1, 3, 1.5]) * 2)
    rename, chat = summarize(rows, servers)
    assert rename["kind"] == "edit: rename" and rename["requests"] == 1
    assert rename["servers"]["ours"] == {"seconds": 11, "ttft_s": 0.4, "tokens": 100, "rounds": 3,
                                         "failed_rounds": 0}
    cache = rename["servers"]["llama-server ngram-cache"]
    assert (cache["seconds"], cache["rounds"], cache["failed_rounds"]) == (13, 1, 1)
    assert rename["best_peer"] == "llama-server ngram-cache"  # 13 s against ngram-mod's 15 and plain's 20
    assert rename["vs_best_rounds"] == [pytest.approx(13 / 10)]  # only the rounds both finished
    assert rename["vs_peer"]["llama-server ngram-mod"] == pytest.approx(1.5)  # median of 1.5, 1.5, 12/11
    assert rename["vs_peer"]["llama-server"] == pytest.approx(20 / 11)
    assert rename["ttft_minus_best_peer_s"] == pytest.approx(0.1)  # ours 0.4, the best TTFT 0.3
    assert chat["requests"] == 2 and chat["servers"]["ours"]["seconds"] == 2
    assert chat["best_peer"] == "llama-server" and chat["servers"]["llama-server"]["seconds"] == 1.5
    assert chat["vs_best"] == {"min": 0.5, "median": 0.75, "max": 1.5}
    totals = overall([rename, chat])
    assert totals["edits"] == pytest.approx(1.3) and totals["chat"] == 0.75
    table = markdown_table({"config": {"servers": servers}, "summary": [rename, chat]}).splitlines()
    assert table[0].startswith("| kind | ours | llama-server plain | llama-server ngram-mod |")
    assert table[2] == ("| edit: rename | 11.00 s (0.40) | 20.00 s (0.50) | 15.00 s (0.30) | 13.00 s (0.50) | "
                        "ngram-cache | 1.30 / 1.30 / 1.30× |")
    assert table[3].endswith("| – | – | plain | 0.50 / 0.75 / 1.50× |")
    alone = summarize(_rows("edit: rename", "ours", [3, 4, 5]), ["ours"])[0]
    assert alone["best_peer"] is None and alone["vs_best"] is None and alone["servers"]["ours"]["seconds"] == 4


# ------------------------------------------------------------------------------------------------ end to end
SMALL = '''LIMIT = 8


def _helper(x):
    return x * LIMIT


def main(values):
    return _helper(values[0]) + _helper(values[1])
'''


def _run(args, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import specdecode.bench.corpus_run as run
    import specdecode.bench.peer_matrix as matrix
    from specdecode.cli.app import app

    monkeypatch.setattr(matrix, "QUIET_MAX_S", 0.0)  # the other worker keeps the machine busy
    # the tiny models hold 512 positions: a small module stands in for the corpus's (their rule is tested above)
    monkeypatch.setattr(run, "pick_tasks", lambda count, kinds, max_tokens: [
        corpus.rename_task(Module("stdlib", "small.py", "/small.py", SMALL), ast.parse(SMALL))][:count])
    path = tmp_path / "corpus.json"
    result = CliRunner().invoke(app, ["bench", "serve", "--workload", "corpus", "--modules", "1", "--edit-kinds",
                                      "rename", "--chat-kinds", "follow-up", "--max-tokens", "12", "--think-s",
                                      "0.05", "--json", str(path), *args])
    assert result.exit_code == 0, result.output
    return result.output, json.loads(path.read_text())


def _serve(tiny_model_dirs) -> str:
    return (f"--target {tiny_model_dirs['target']} --draft {tiny_model_dirs['draft']} --draft-quantize none "
            f"--threads 1")


def test_the_command_on_a_fresh_server_of_ours_each_round_and_stand_in_peers(tiny_model_dirs, tmp_path,
                                                                             monkeypatch):
    from llama_server_standin import install

    (tmp_path / "model.gguf").write_bytes(b"")
    output, report = _run(["--serve", _serve(tiny_model_dirs), "--rounds", "2", "--llama-server",
                           install(tmp_path), "--peer-gguf", str(tmp_path / "model.gguf"), "--spec-types",
                           "ngram-mod", "--threads", "1"], tmp_path, monkeypatch)
    servers = ["ours", "llama-server", "llama-server ngram-mod"]
    assert report["config"]["servers"] == servers and report["config"]["ours_fresh_each_round"]
    assert report["config"]["modes"] == {"plain": [], "ngram-mod": ["--spec-type", "ngram-mod"]}
    # one at a time, each started afresh each round, the order rotated
    assert [(s["round"], s["server"]) for s in report["sessions"]] == [
        (1, "ours"), (1, "llama-server"), (1, "llama-server ngram-mod"),
        (2, "llama-server"), (2, "llama-server ngram-mod"), (2, "ours")]
    assert all(s["warm_up_error"] is None and s["failed"] == 0 for s in report["sessions"]), report["sessions"]
    kinds = ["chat: follow-up: first turn (back to back)", "chat: follow-up (back to back)",
             "chat: follow-up: first turn (think 0.05 s)", "chat: follow-up (think 0.05 s)", "edit: rename"]
    ours = [r for r in report["requests"] if r["server"] == "ours"]
    # the two follow-up chats back to back, then again with the think-time, then the edit
    assert [r["kind"] for r in ours if r["round"] == 1] == [*kinds[:2] * 2, *kinds[2:4] * 2, kinds[4]]
    for row in report["requests"]:  # every request's raw times
        assert row["ok"] and 0 < row["ttft_s"] <= row["seconds"] and row["output_tokens"] > 0, row
    assert all(r["output_tokens"] <= 12 and r["hit_max_tokens"] == (r["output_tokens"] == 12) for r in ours)
    first, second = [r for r in ours if r["round"] == 1 and r["task"] == "follow-up 1"][:2]
    assert second["prompt_tokens"] > first["prompt_tokens"]  # the follow-up carries the first answer
    edit = next(r for r in ours if r["kind"] == "edit: rename")
    assert edit["check"]["as_asked"] is False  # random weights: whatever the answer, not the edit
    assert report["modules"][0]["name"] == "small.py" and report["modules"][0]["details"]["old"] == "_helper"
    assert [row["kind"] for row in report["summary"]] == kinds
    for row in report["summary"]:
        assert row["servers"]["ours"]["rounds"] == 2 and row["best_peer"] in servers[1:]
        assert row["vs_best"]["min"] <= row["vs_best"]["median"] <= row["vs_best"]["max"]
    assert report["summary"][-1]["as_asked"]["ours"] == [0, 2]
    assert "median of the kinds' median ratios to the best peer" in output and "vCPU" in output
    assert "small.py (rename" in output


def test_the_command_against_the_real_llama_server(tiny_model_dirs, smol_path, tmp_path, monkeypatch):
    from specdecode.bench.llama_server import default_binary

    if not default_binary().is_file():
        pytest.skip(f"llama-server is not built at {default_binary()}: bash scripts/build_llama_server.sh")
    output, report = _run(["--serve", _serve(tiny_model_dirs), "--rounds", "1", "--llama-server",
                           str(default_binary()), "--peer-gguf", str(smol_path), "--spec-types", "ngram-mod",
                           "--threads", "1", "--peer-context", "2048"], tmp_path, monkeypatch)
    peer = [r for r in report["requests"] if r["server"].startswith("llama-server")]
    assert peer and all(r["ok"] and r["ttft_s"] > 0 and r["seconds"] >= r["ttft_s"] for r in peer)
    assert report["summary"][0]["best_peer"] in ("llama-server", "llama-server ngram-mod")


def test_options_of_the_corpus_are_checked_before_anything_starts():
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    def run(*args):
        return CliRunner().invoke(app, ["bench", "serve", "--workload", "corpus", *args])

    result = CliRunner().invoke(app, ["bench", "serve", "--workload", "matrix", "--rounds", "2"])
    assert result.exit_code != 0 and "--rounds does not apply to --workload matrix" in result.output
    result = run("--serve", "--port 8000")
    assert result.exit_code != 0 and "leave --port out" in result.output
    result = run("--edit-kinds", "poetry", "--serve", "--threads 1")
    assert result.exit_code != 0 and "unknown edit kind" in result.output
    result = run("--spec-types", "ngram-mod", "--serve", "--threads 1")
    assert result.exit_code != 0 and "give --peer-gguf" in result.output
