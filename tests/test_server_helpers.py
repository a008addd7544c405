"""Helpers of the server tests (no tests here): a live uvicorn server on loopback, generators on the tiny models."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from specdecode import SpeculativeGenerator
from specdecode.server import ServerSettings, create_app

MODEL = "tiny-target"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: for the tiny models on this shared 2-core machine it is tens of times faster than two
    (OpenMP threads spin against each other and against the other processes). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_generator(tiny_pair, tokenizer, k: int = 4) -> SpeculativeGenerator:
    """A generator of its own on the shared tiny models (each server's worker must own its generator)."""
    target, draft = tiny_pair
    return SpeculativeGenerator(target, draft, num_speculative_tokens=k, tokenizer=tokenizer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving an app in a background thread on 127.0.0.1, on a port the OS picks."""

    def __init__(self, app, graceful_s: float = 5.0):
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=graceful_s,
                                access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "LiveServer":
        if self.thread.is_alive() or self.server.started:
            return self
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve(tiny_pair, tokenizer, k: int = 4, **settings) -> LiveServer:
    """Build an app on a fresh generator with these settings and start serving it."""
    app = create_app(make_generator(tiny_pair, tokenizer, k), MODEL, tokenizer, ServerSettings(**settings))
    return LiveServer(app).start()


def metric_values(url: str, headers: dict | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def metric(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class SlowGenerator:
    """Wraps a generator so that each engine step takes at least `delay` seconds and EOS never ends a row early:
    long, predictable generations for the timeout, disconnect, queue-full, cancellation and shutdown tests.
    `stall_next(s)`: the next step takes s seconds more, once (a stalled engine)."""

    def __init__(self, generator, delay: float):
        self._generator = generator
        self.delay = delay
        self.stall_s = 0.0

    def stall_next(self, seconds: float) -> None:
        self.stall_s = seconds

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def request(self, *args, **kwargs):
        return self._generator.request(*args, **{**kwargs, "ignore_eos": True})

    def session(self, **kwargs):
        session = self._generator.session(**kwargs)
        decode = session.decode  # the batcher runs each step as admit() then decode()

        def slow_decode():
            stall, self.stall_s = self.stall_s, 0.0
            time.sleep(self.delay + stall)
            return decode()

        session.decode = slow_decode
        return session


def serve_slow(tiny_pair, tokenizer, delay: float, **settings) -> LiveServer:
    app = create_app(SlowGenerator(make_generator(tiny_pair, tokenizer), delay), MODEL, tokenizer,
                     ServerSettings(**settings))
    return LiveServer(app).start()


def error_shape(response) -> dict:
    """The OpenAI error body of a response, checked: {"error": {"message", "type", "param", "code"}}."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error


class CLIServer:
    """`python -m specdecode serve ARGS` in a subprocess, its stderr (the server's log) written to a file."""

    def __init__(self, args: list[str], log_path, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_COLOR="1")
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "specdecode", "serve", *args], env=env,
                                         stdout=subprocess.DEVNULL, stderr=log)

    def wait_up(self, timeout: float = 120.0) -> "CLIServer":
        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}: {self.log()}")
            try:
                return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, timeout=timeout, interval=0.25), f"the server did not come up: {self.log()}"
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send a signal and wait: the exit code."""
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def log(self) -> str:
        with open(self.log_path, newline="") as f:  # newline="": carriage returns stay visible
            return f.read()

    def __enter__(self):
        return self.wait_up()

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def tiny_serve_args(tiny_model_dirs, port: int) -> list[str]:
    """`specdecode serve` options for the tiny models, on one thread."""
    return ["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"], "--draft-quantize", "none",
            "--threads", "1", "--port", str(port)]


def openai_client(url: str, timeout: float = 60):
    """The official client on a test server (no retries: a failure must show)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def chat_ids(tokenizer, messages) -> list[int]:
    """The prompt ids the server builds for a chat request (its template, no extra special tokens)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
