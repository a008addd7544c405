"""llama.cpp's own server (`llama-server`) as a peer of ours in `specdecode bench serve`: the CPU user's real
alternative, started as its users run it, on the same GGUF, threads and context.

LlamaServer starts the binary on 127.0.0.1 (a port the OS picks) with `--jinja` (the GGUF's own chat template,
tools included, parsed into `tool_calls` by llama.cpp's handlers), `-t/-tb` threads, `-c` context per slot times
`-np` slots, no GPU layers, and everything else at its defaults: its prompt cache (`cache_prompt`, on by default:
a slot reuses the common prefix of its last prompt and answer) stays on, as its users have it. It waits for
/health, and stops the process (SIGTERM, then SIGKILL) when the bench ends. Its output goes to a log file whose
tail is quoted when it fails to start.

The binary: `--llama-server PATH`, or the one scripts/build_llama_server.sh builds from the llama.cpp source that
the installed llama-cpp-python vendors (~/.cache/specdecode/llama-server-<version>/llama-server). No PyPI package
ships a prebuilt one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BUILD_HINT = "build it with: bash scripts/build_llama_server.sh (or give --llama-server PATH)"


def default_binary() -> Path:
    """Where scripts/build_llama_server.sh puts the binary for the installed llama-cpp-python."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    cache = Path(os.environ.get("SPECDECODE_CACHE", Path.home() / ".cache" / "specdecode"))
    return cache / f"llama-server-{version}" / "llama-server"


def find_binary(path: str | None = None) -> str:
    """The llama-server executable: the path given (or a name on PATH), else the built one."""
    if path:
        resolved = shutil.which(path) or (path if os.path.isfile(path) else None)
        if resolved is None or not os.access(resolved, os.X_OK):
            raise FileNotFoundError(f"--llama-server {path}: no such executable; {BUILD_HINT}")
        return resolved
    built = default_binary()
    if built.is_file() and os.access(built, os.X_OK):
        return str(built)
    raise FileNotFoundError(f"no llama-server at {built}; {BUILD_HINT}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server process on 127.0.0.1 (a port the OS picks), started with `command` and stopped when done: `with
    Server(...) as server: server.url`. It waits for /health; its output goes to a log file whose tail is quoted
    when it fails to start. `env`: variables set for it beside this process's."""

    name = "the server"

    def __init__(self, startup_timeout_s: float = 300.0, env: dict[str, str] | None = None):
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log_path: str | None = None

    @property
    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self):
        fd, self.log_path = tempfile.mkstemp(prefix=f"specdecode-{self.name.split()[-1]}-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env={**os.environ, **self.env} if self.env else None)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode} before it was ready: "
                                   f"{' '.join(self.command)}\n{self.log_tail()}")
            try:  # 503 while the model loads, 200 once it serves
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} was not ready within {self.startup_timeout_s:g} s: "
                           f"{' '.join(self.command)}\n{self.log_tail()}")

    def log_tail(self, lines: int = 12) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        text = Path(self.log_path).read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.strip().splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            _signal(process, signal.SIGTERM)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal(process, signal.SIGKILL)
                process.wait(timeout=grace_s)
        if self.log_path and os.path.exists(self.log_path):
            os.unlink(self.log_path)
        self.log_path = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LlamaServer(ServerProcess):
    """A llama-server process on 127.0.0.1: `with LlamaServer(...) as server: server.url`."""

    name = "llama-server"

    def __init__(self, binary: str, gguf: str, threads: int, context: int, parallel: int = 1,
                 extra_args: tuple = (), startup_timeout_s: float = 300.0):
        if parallel < 1 or context < 1 or threads < 1:
            raise ValueError(f"llama-server needs threads, context and parallel >= 1, got {threads}, {context}, "
                             f"{parallel}")
        super().__init__(startup_timeout_s)
        self.binary, self.gguf = binary, str(gguf)
        self.threads, self.context, self.parallel = threads, context, parallel
        self.extra_args = tuple(extra_args)

    @property
    def command(self) -> list[str]:
        # -c is the whole KV cache, shared by the -np slots: each slot gets `context` positions
        return [self.binary, "-m", self.gguf, "--jinja", "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.context * self.parallel),
                "-np", str(self.parallel), "-ngl", "0", *self.extra_args]


def _signal(process: subprocess.Popen, sig: int) -> None:
    # the server runs in its own session: its process group is exactly it and what it started
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
