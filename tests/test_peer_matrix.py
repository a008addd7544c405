"""`specdecode bench serve --workload matrix`: the workloads' requests, the summary (the best peer mode per workload,
never the weakest; a failed server left out), llama-server's arguments per mode, and the command end to end on a live
tiny server of ours and llama-server stand-ins (tests/llama_server_standin.py) in two modes, on 127.0.0.1 only."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from llama_server_standin import install
from specdecode import SpeculativeGenerator, SuffixDrafter
from specdecode.bench.peer_matrix import MatrixSettings, decode_rate, summarize, workloads
from specdecode.bench.serve import RequestRecord
from specdecode.cli.bench_serve_cmd import bench_serve as bench_serve_command
from specdecode.cli.bench_serve_matrix import mode_args
from specdecode.cli.common import CLIError
from specdecode.server import ServerSettings, create_app
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, LiveServer


def _cell(rate, ok=True, texts=("a",), seconds=None):
    return {"ok": ok, "decode_tok_s": rate, "texts": list(texts), "errors": [] if ok else ["boom"],
            **({} if seconds is None else {"seconds": seconds})}


def test_the_summary_takes_the_best_peer_mode_and_leaves_failed_ones_out():
    cells = {"edit": {"ours": _cell(30.0), "llama-server": _cell(10.0), "llama-server ngram-mod": _cell(29.0),
                      "llama-server ngram-simple": _cell(27.0), "llama-server ngram-cache": _cell(99.0, ok=False)},
             "novel": {"ours": _cell(9.0, texts=("b",)), "llama-server": _cell(10.0),
                       "llama-server ngram-mod": _cell(9.5)}}
    edit, novel = summarize(cells)
    assert (edit["best_mode"], edit["best_mode_tok_s"], edit["best_peer_tok_s"]) == ("llama-server ngram-mod", 29.0,
                                                                                     29.0)
    assert edit["vs_best"] == pytest.approx(30 / 29) and edit["vs_plain"] == pytest.approx(3.0)
    assert edit["same_text_as_plain"] is True
    # where plain decoding is the peer's best, it is the figure we are compared with
    assert novel["best_peer_tok_s"] == 10.0 and novel["vs_best"] == pytest.approx(0.9)
    assert novel["same_text_as_plain"] is False


def test_the_summary_compares_the_time_to_each_answer_with_the_fastest_peer():
    # a peer that did not constrain a tool call decodes 256 filler tokens fast; its user waits longer for the answer
    cells = {"agent": {"ours": _cell(25.0, seconds=3.0), "llama-server": _cell(14.0, seconds=20.0),
                       "llama-server ngram-mod": _cell(33.0, seconds=9.0),
                       "llama-server ngram-cache": _cell(50.0, ok=False, seconds=1.0)}}
    (agent,) = summarize(cells)
    assert agent["vs_best"] == pytest.approx(25 / 33)
    assert (agent["fastest_peer"], agent["fastest_peer_s"], agent["ours_s"]) == ("llama-server ngram-mod", 9.0, 3.0)
    assert agent["time_vs_fastest"] == pytest.approx(3.0)


def test_a_decode_rate_counts_the_tokens_after_the_first():
    record = RequestRecord(0, 0.0, status=200, ttft_s=1.0, latency_s=3.0, output_tokens=21)
    record.last_token_s = 3.0
    assert decode_rate(record) == pytest.approx(10.0)
    record.output_tokens = 1
    assert decode_rate(record) is None


def test_the_workloads_and_their_checks():
    rows = workloads()
    assert list(rows) == ["novel code", "edit: type hints", "edit: rename", "chat quoting its answer", "json schema",
                          "agent tool loop"]
    quoting = rows["chat quoting its answer"]
    assert quoting[1].messages(["FIRST ANSWER"])[1] == {"role": "assistant", "content": "FIRST ANSWER"}
    assert "def bisect_right(" in rows["edit: rename"][0].messages([])[1]["content"]  # a real module, read at run time
    assert rows["json schema"][0].extra["response_format"]["type"] == "json_schema"
    # the tool loop's ask is one the file it has read does not meet already, so the answer is the file written back
    agent = rows["agent tool loop"][0].messages([])
    ask, source = agent[1]["content"], agent[-1]["content"]
    line = ask.split("`")[1]
    assert line.startswith("# ") and line not in source and "def bisect_right(" in source
    assert "write_file" in ask and rows["agent tool loop"][0].extra["tool_choice"] == "required"
    with pytest.raises(ValueError, match="temperature must be 0"):
        MatrixSettings(url="x", temperature=0.7)
    with pytest.raises(ValueError, match="unknown matrix workload"):
        MatrixSettings(url="x", only=["poetry"])


def test_each_mode_starts_llama_server_as_its_users_do():
    assert mode_args("plain", None) == ()
    assert mode_args("ngram-mod", None) == ("--spec-type", "ngram-mod")
    assert mode_args("draft-simple", "d.gguf") == ("--spec-type", "draft-simple", "-md", "d.gguf")
    with pytest.raises(CLIError, match="--draft-gguf"):
        mode_args("draft-simple", None)


@pytest.fixture(scope="module")
def ours(tiny_pair, tokenizer):
    target, _ = tiny_pair
    generator = SpeculativeGenerator(target, SuffixDrafter(), num_speculative_tokens="auto", tokenizer=tokenizer)
    srv = LiveServer(create_app(generator, MODEL, tokenizer, ServerSettings(draft_name="suffix"))).start()
    yield srv
    srv.stop()


def test_the_command_runs_the_matrix_on_ours_and_each_mode(ours, tmp_path, monkeypatch):
    import specdecode.bench.peer_matrix as matrix

    monkeypatch.setattr(matrix, "QUIET_MAX_S", 0.0)  # the suite's other worker keeps the machine busy
    binary = install(tmp_path)
    (tmp_path / "target.gguf").write_bytes(b"")
    (tmp_path / "draft.gguf").write_bytes(b"")
    cli = typer.Typer()
    cli.command()(bench_serve_command)
    result = CliRunner().invoke(cli, [
        "--url", ours.url, "--workload", "matrix", "--llama-server", binary, "--peer-gguf",
        str(tmp_path / "target.gguf"), "--spec-types", "ngram-mod,draft-simple", "--draft-gguf",
        str(tmp_path / "draft.gguf"), "--only", "novel code,chat quoting its answer,json schema", "--max-tokens", "8",
        "--threads", "1", "--json", str(tmp_path / "m.json"), "--plot", str(tmp_path / "m.png")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "m.json").read_text())
    servers = ["ours", "llama-server", "llama-server ngram-mod", "llama-server draft-simple"]
    assert list(report["config"]["servers"]) == servers
    assert report["config"]["modes"]["draft-simple"] == ["--spec-type", "draft-simple", "-md",
                                                         str(tmp_path / "draft.gguf")]
    assert list(report["cells"]) == ["novel code", "chat quoting its answer", "json schema"]
    for workload, cells in report["cells"].items():
        assert set(cells) == set(servers), workload
        assert all(cell["ok"] and cell["decode_tok_s"] > 0 for cell in cells.values()), (workload, cells)
    assert report["cells"]["chat quoting its answer"]["ours"]["requests"] == 2  # the second turn quotes the first
    for row in report["summary"]:
        assert row["best_mode"] in servers[2:] and row["vs_best"] > 0
    assert report["config"]["warm_up_errors"] == {}
    assert all(row["time_vs_fastest"] > 0 for row in report["summary"])
    assert (tmp_path / "m.png").stat().st_size > 10_000
    assert "ours / the best llama-server mode" in result.output and "vCPU" in result.output


class _Load:
    """OthersLoad's stand-in: the shares it reads, in turn."""

    def __init__(self, shares):
        self.shares = shares

    def __call__(self):
        gauge = self

        class Gauge:
            share = None

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.share = gauge.shares.pop(0)
        return Gauge()


def test_a_request_waits_for_a_quiet_machine_within_a_bound():
    import asyncio

    from specdecode.bench.peer_matrix import wait_quiet

    assert asyncio.run(wait_quiet(10, 0.01, _Load([0.9, 0.5, 0.05, 0.9]))) == pytest.approx(0.03)  # the third window
    assert asyncio.run(wait_quiet(0.05, 0.01, _Load([0.9] * 10))) == pytest.approx(0.05)  # never quiet: bounded


def test_every_server_answers_one_untimed_warm_up_before_any_workload(monkeypatch):
    import contextlib

    import specdecode.bench.peer_matrix as matrix

    sent = []

    @contextlib.asynccontextmanager
    async def client(settings, width):
        yield settings.url

    async def stream(url, path, body, record):
        sent.append((url, body["messages"], body["max_tokens"]))
        record.status, record.ttft_s, record.latency_s, record.output_tokens = 200, 0.1, 1.0, 5
        record.last_token_s, record.text = 1.0, "answer"
        return record

    async def quiet(*args, **kwargs):
        return 0.0

    monkeypatch.setattr(matrix, "make_client", client)
    monkeypatch.setattr(matrix, "stream_request", stream)
    monkeypatch.setattr(matrix, "wait_quiet", quiet)
    servers = {"ours": "http://a", "llama-server": "http://b", "llama-server ngram-mod": "http://c"}
    report = matrix.run_matrix(MatrixSettings(url="http://a", max_tokens=32, only=["novel code"]), servers)
    warm = [(url, tokens) for url, messages, tokens in sent if messages == matrix.WARMUP]
    assert warm == [(url, matrix.WARMUP_TOKENS) for url in servers.values()]
    assert [url for url, *_ in sent[:3]] == list(servers.values())  # all warm-ups come first
    assert len(sent) == 6 and all(tokens == 32 for _, _, tokens in sent[3:])
    assert report["cells"]["novel code"]["ours"]["requests"] == 1  # the warm-up is in no cell
    assert report["config"]["warm_up_errors"] == {}
