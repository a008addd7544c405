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


def _cell(rate, ok=True, texts=("a",)):
    return {"ok": ok, "decode_tok_s": rate, "texts": list(texts), "errors": [] if ok else ["boom"]}


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
