"""llama-server as the bench's peer (bench/llama_server.py), checked against a stand-in that speaks its command line
and its HTTP API (tests/llama_server_standin.py), so that CI needs no llama.cpp build: the command (--jinja,
127.0.0.1, threads, context per slot, no GPU layers), waiting for /health, the error that quotes its log when it
exits or never becomes ready, the process stopped with the bench, and the agent workload run through it. The real
binary is exercised in tests/test_bench_serve_agent.py where scripts/build_llama_server.sh has built it."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from llama_server_standin import install
from specdecode.bench.agent_tasks import AgentTask
from specdecode.bench.llama_server import LlamaServer, default_binary, find_binary
from specdecode.bench.serve_agent import LLAMA_SERVER, AgentBenchSettings, bench_agent


@pytest.fixture()
def binary(tmp_path):
    return install(tmp_path)


def test_it_starts_with_the_peer_settings_waits_for_health_and_stops(binary, tmp_path, monkeypatch):
    argv = tmp_path / "argv.json"
    monkeypatch.setenv("STANDIN_ARGV", str(argv))
    server = LlamaServer(binary, "model.gguf", threads=2, context=4096, parallel=2)
    with server:
        assert httpx.get(f"{server.url}/health").status_code == 200  # ready when start() returns
        process, log = server.process, server.log_path
        assert server.url.startswith("http://127.0.0.1:") and os.path.exists(log)
        assert "server is listening" in server.log_tail()
    assert json.loads(argv.read_text()) == server.command[1:]
    command = " ".join(server.command)
    for part in ("-m model.gguf", "--jinja", "--host 127.0.0.1", f"--port {server.port}", "-t 2", "-tb 2",
                 "-c 8192", "-np 2", "-ngl 0"):
        assert part in command, command
    assert process.poll() is not None and not os.path.exists(log) and server.process is None


def test_a_server_that_exits_early_is_an_error_quoting_its_log(binary, monkeypatch):
    monkeypatch.setenv("STANDIN_MODE", "exit")
    server = LlamaServer(binary, "missing.gguf", threads=1, context=512)
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 before it was ready.*failed to load model"):
        server.start()
    assert server.process is None


def test_a_server_never_ready_times_out_and_is_stopped(binary, monkeypatch):
    monkeypatch.setenv("STANDIN_MODE", "hang")
    server = LlamaServer(binary, "model.gguf", threads=1, context=512, startup_timeout_s=1.0)
    with pytest.raises(TimeoutError, match="not ready within 1 s"):
        server.start()
    assert server.process is None
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.url}/health", timeout=2.0)  # nothing listens any more


def test_finding_the_binary(binary, tmp_path, monkeypatch):
    assert find_binary(binary) == binary
    with pytest.raises(FileNotFoundError, match="build_llama_server.sh"):
        find_binary(str(tmp_path / "nope"))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    assert str(default_binary()).startswith(str(tmp_path / "cache" / "llama-server-"))
    with pytest.raises(FileNotFoundError, match="no llama-server at"):
        find_binary(None)
    default_binary().parent.mkdir(parents=True)
    os.symlink(binary, default_binary())
    assert find_binary(None) == str(default_binary())
    with pytest.raises(ValueError, match=">= 1"):
        LlamaServer(binary, "m.gguf", threads=0, context=512)


def test_the_agent_workload_runs_its_sessions_on_the_started_server(binary, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    tasks = [AgentTask(f"t{i}", f"Task {i}.", {"a.py": "x = 1\n"}, check="import a") for i in range(2)]
    settings = AgentBenchSettings(servers=[], peer_gguf=str(gguf), llama_server=binary, function_calling=False,
                                  peer_threads=1, peer_context=1024, tasks=tasks, timeout_s=30)
    report = bench_agent(settings)
    assert report["config"]["methods"] == [LLAMA_SERVER] and not report["errors"], report["errors"]
    assert report["config"]["commands"][LLAMA_SERVER][1:3] == ["-m", str(gguf)]
    totals = report["methods"][LLAMA_SERVER]
    assert (totals["tasks"], totals["completed"], totals["turns"], totals["valid_calls"]) == (2, 2, 4, 2)
    # one chunk of text a turn: the decode rate is the server's own, 2 tokens after the first in 20 ms
    assert totals["ended"] == {"answer": 2} and totals["decode_tokens_per_s"] == pytest.approx(100.0)
    records = report["records"]
    # turn 1 finds the warm-up's system prompt in the stand-in's cache, turn 2 its own turn 1
    assert all(r["cached_tokens"] > 0 and r["timings"]["cache_n"] == r["cached_tokens"] for r in records)
    assert records[1]["cached_tokens"] > records[0]["cached_tokens"]
