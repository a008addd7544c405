"""The README's server examples, run as written against a real `specdecode serve` on the tiny models.

The README's server section has a ```bash block (the `specdecode serve` command, then curl commands) and a ```python
block (the `openai` client). The serve command runs with the tiny models appended to it, every curl command runs as
written, and so does the Python snippet; port 8000 is replaced by a free port everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_server_helpers import CLIServer, free_port

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
README_PORT = "8000"


def code_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block of the README."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(README.read_text(encoding="utf-8"))]


def server_blocks() -> tuple[str, str]:
    """The README's server examples: the bash block that starts the server, and the Python client block."""
    shell = [code for lang, code in code_blocks() if lang in ("bash", "sh", "shell") and "specdecode serve" in code]
    python = [code for lang, code in code_blocks() if lang == "python" and "from openai import OpenAI" in code]
    assert len(shell) == 1, "README.md needs one ```bash block with the `specdecode serve` command and curl"
    assert len(python) == 1, "README.md needs one ```python block using `from openai import OpenAI`"
    return shell[0], python[0]


def commands(block: str) -> list[list[str]]:
    """The commands of a shell block, each as argv: backslash continuations joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


@pytest.fixture(scope="module")
def examples(tiny_model_dirs, tmp_path_factory):
    """(server, the curl commands, the Python snippet), the README's port replaced by the server's."""
    port = str(free_port())
    shell, python = (block.replace(README_PORT, port) for block in server_blocks())
    argvs = commands(shell)
    serve = [a for a in argvs if a[:2] == ["specdecode", "serve"]]
    curls = [a for a in argvs if a[0] == "curl"]
    assert len(serve) == 1 and curls, f"expected one `specdecode serve` and at least one curl command: {argvs}"
    assert len(serve) + len(curls) == len(argvs), f"commands this test cannot run: {argvs}"
    tiny = ["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"], "--draft-quantize", "none",
            "--threads", "1"]
    log = tmp_path_factory.mktemp("readme") / "serve.log"
    with CLIServer(serve[0][2:] + tiny, log, int(port)) as srv:
        yield srv, curls, python
        assert srv.stop(signal.SIGINT) == 0  # Ctrl-C: a graceful stop
        assert srv.log().splitlines()[-1].endswith("server stopped"), srv.log()


def _env() -> dict:
    return dict(os.environ, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")


def test_readme_curl_examples(examples):
    _, curls, _ = examples
    for argv in curls:
        done = subprocess.run(argv + ["--silent", "--show-error"], capture_output=True, text=True, timeout=120,
                              env=_env())
        assert done.returncode == 0, (argv, done.stderr)
        body = json.loads(done.stdout)
        assert "error" not in body and ("choices" in body or "data" in body), (argv, body)
        if "choices" in body:  # a completion: text was generated
            assert body["usage"]["completion_tokens"] >= 1, body


def test_readme_openai_client_example(examples):
    _, _, python = examples
    done = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 0, done.stderr
