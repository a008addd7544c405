"""Every flag of `generate`, `serve` and `bench` works on the backend and with the draft that run, or is refused
before any model loads, with a message that names the flag, what runs (the backend, or the draft) and what to use
instead (cli/applies.py). A flag left at its default, or given a value that asks for what the backend does anyway
(--no-prepack on llama.cpp), is accepted.

The llama.cpp cases run on an empty file named .gguf: the backend is chosen from the name, as load_model would,
and nothing reads the file, since the refusal comes first. Any load at all fails these tests (load_model raises)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specdecode.cli.app import app

LOADED = "a model load was attempted"


@pytest.fixture(autouse=True)
def no_loading(monkeypatch):
    from specdecode.pairing import loading

    def load_model(*args, **kwargs):
        raise RuntimeError(LOADED)

    monkeypatch.setattr(loading, "load_model", load_model)


@pytest.fixture
def models(tiny_model_dirs, tmp_path):
    pytest.importorskip("llama_cpp", reason="auto picks llama.cpp for a GGUF only where it is installed")
    gguf = tmp_path / "stub.gguf"
    gguf.write_bytes(b"")
    return {"T": tiny_model_dirs["target"], "D": tiny_model_dirs["draft"], "G": str(gguf)}


def run(models: dict, command: list[str], *args: str):
    argv = [*command, *(models.get(a, a) for a in args)]
    argv = [a.replace("+D", "+" + models["D"]) for a in argv]
    result = CliRunner().invoke(app, argv)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


GENERATE, SERVE, BENCH = ["generate", "def f():", "-n", "4"], ["serve"], ["bench", "-n", "4", "--runs", "1"]

# (command, arguments, what the error must say: the flag as given, what runs, the fix)
REFUSED = [
    # the default backend on a CPU (llama.cpp, for a GGUF)
    (GENERATE, ["--target", "G", "--dtype", "bfloat16"],
     ["--dtype bfloat16", "llamacpp backend", "--backend transformers"]),
    (GENERATE, ["--target", "G", "--quantize", "int8"],
     ["--quantize int8", "llamacpp backend", "--backend transformers"]),
    (GENERATE, ["--target", "G", "--prepack"], ["--prepack", "llamacpp backend", "leave --prepack out"]),
    (GENERATE, ["--target", "G", "--trust-remote-code"], ["--trust-remote-code", "llamacpp backend", "leave it out"]),
    (SERVE, ["--target", "G", "--dtype", "float16"], ["--dtype float16", "llamacpp backend", "--backend transformers"]),
    (BENCH, ["--target", "G", "--quantize", "int8"],
     ["--quantize int8", "llamacpp backend", "--backend transformers"]),
    # transformers
    (GENERATE, ["--target", "T", "--draft", "none", "--exact-greedy"],
     ["--exact-greedy", "transformers backend", "--backend llamacpp"]),
    (GENERATE, ["--target", "T", "--draft", "none", "--huge-pages"],
     ["--huge-pages", "transformers backend", "--backend llamacpp"]),
    (SERVE, ["--target", "T", "--draft", "none", "--prefix-cache-rows", "2"],
     ["--prefix-cache-rows 2", "transformers backend", "--prefix-cache-tokens"]),
    (GENERATE, ["--target", "T", "--draft", "none", "--prepack", "--dtype", "bfloat16"],
     ["--prepack", "transformers backend", "bfloat16", "leave --prepack out"]),
    (GENERATE, ["--target", "T", "--draft", "none", "--prepack", "--quantize", "int8"],
     ["--prepack", "transformers backend", "--quantize int8", "leave --prepack out"]),
    (GENERATE, ["--target", "T", "--draft", "none", "--quantize", "int4"],
     ["--quantize int4", "CUDA", "--quantize int8"]),
    # static: chains only, no prefix cache
    (GENERATE, ["--target", "T", "--backend", "static", "--draft", "suffix", "--tree-width", "2"],
     ["--tree-width 2", "static backend", "--backend transformers or llamacpp"]),
    (SERVE, ["--target", "T", "--backend", "static", "--draft", "none", "--prefix-cache-tokens", "1024"],
     ["--prefix-cache-tokens 1024", "static backend", "--prefix-cache-tokens 0"]),
    (SERVE, ["--target", "T", "--backend", "static", "--draft", "none", "--answer-kv", "lend"],
     ["--answer-kv lend", "static backend", "--backend transformers or llamacpp"]),
    # the draft
    (GENERATE, ["--target", "T", "--draft", "suffix+D", "--tree-width", "3"],
     ["--tree-width 3", "--draft suffix+", "use --draft suffix"]),
    (GENERATE, ["--target", "T", "--draft", "D", "--tree-width", "2"],
     ["--tree-width 2", "--draft ", "use --draft suffix"]),
    (GENERATE, ["--target", "T", "--draft", "prompt-lookup", "--tree-width", "2"],
     ["--tree-width 2", "--draft prompt-lookup", "use --draft suffix"]),
    (GENERATE, ["--target", "T", "--draft", "none", "-k", "4"], ["-k 4", "--draft none", "give a draft"]),
    (SERVE, ["--target", "T", "--draft", "none", "--method", "chen"],
     ["--method chen", "--draft none", "give a draft"]),
    (GENERATE, ["--target", "T", "--draft", "D", "--suffix-history-tokens", "100"],
     ["--suffix-history-tokens 100", "--draft ", "use --draft suffix or suffix+MODEL"]),
    (SERVE, ["--target", "T", "--draft", "none", "--escaped-copies"],
     ["--escaped-copies", "--draft none", "use --draft suffix or suffix+MODEL"]),
    # generate's own
    (GENERATE, ["--target", "T", "--draft", "none", "--batch-size", "4"],
     ["--batch-size 4", "one PROMPT", "--prompts-file"]),
    (GENERATE, ["--target", "T", "--draft", "none", "--json", "--no-echo"],
     ["--echo/--no-echo", "--json", "leave it out"]),
    (GENERATE, ["--target", "T", "--draft", "none", "--json", "--stream"], ["--stream/--no-stream", "--json"]),
    # sampling options at temperature 0: greedy draws nothing
    (GENERATE, ["--target", "T", "--draft", "none", "--top-k", "5"], ["--top-k 5", "temperature 0", "--temperature"]),
    (GENERATE, ["--target", "T", "--draft", "none", "--seed", "3"], ["--seed 3", "temperature 0", "--temperature"]),
    (BENCH, ["--target", "T", "--draft", "none", "--top-p", "0.9"], ["--top-p 0.9", "temperature 0", "--temperature"]),
    # a flag of the prefix cache with the cache off
    (SERVE, ["--target", "T", "--draft", "none", "--prefix-cache-tokens", "0", "--answer-kv", "lend"],
     ["--answer-kv lend", "--prefix-cache-tokens 0", "leave it out"]),
    # bench's own
    (BENCH, ["--target", "T", "--draft", "none", "--methods", "specdecode-plain", "--peer-models", "same"],
     ["--peer-models same", "no transformers method", "add hf-plain or hf-assisted"]),
    (BENCH, ["--target", "T", "--draft", "none", "--llama-draft-max", "2,4"],
     ["--llama-draft-max", "--llama-speculative PATH"]),
    (BENCH, ["--target", "T", "--draft", "D", "-k", "2", "--sanity", "--temperature", "0.7"],
     ["--sanity", "--temperature"]),
]


@pytest.mark.parametrize("command,args,said", REFUSED, ids=[" ".join(c[:1] + a) for c, a, _ in REFUSED])
def test_a_flag_that_would_do_nothing_is_refused_before_loading(models, command, args, said):
    result = run(models, command, *args)
    assert result.exit_code == 1, result.output
    assert LOADED not in result.output
    error = result.output.strip().splitlines()[-1]
    assert error.startswith("error: ")
    for words in said:
        assert words in error, (words, error)


ACCEPTED = [
    (GENERATE, ["--target", "G"]),  # the defaults: --prepack and --huge-pages left as they are
    (GENERATE, ["--target", "G", "--no-prepack", "--dtype", "auto", "--quantize", "none", "--exact-greedy",
                "--no-huge-pages", "--huge-pages"]),
    (GENERATE, ["--target", "T", "--draft", "none", "--no-huge-pages", "-k", "auto", "--method", "leviathan",
                "--prepack", "--trust-remote-code", "--dtype", "float32"]),
    (GENERATE, ["--target", "T", "--draft", "suffix", "--tree-width", "3", "--suffix-history-tokens", "100"]),
    (GENERATE, ["--target", "T", "--draft", "none", "--temperature", "0.7", "--top-k", "5", "--seed", "3",
                "--repetition-penalty", "1.2", "--top-p", "1.0"]),
    (BENCH, ["--target", "T", "--draft", "none", "--temperature", "0,0.7", "--top-k", "5", "--seed", "2"]),
    (GENERATE, ["--target", "T", "--draft", "suffix+D", "--suffix-history-tokens", "100", "-k", "3"]),
    (SERVE, ["--target", "G", "--prefix-cache-rows", "2", "--answer-kv", "lend", "--escaped-copies"]),
    (SERVE, ["--target", "T", "--backend", "static", "--draft", "none", "--prefix-cache-tokens", "0"]),
    # bench runs its suffix methods with -k and the history whatever --draft; stock peers take --dtype
    (BENCH, ["--target", "T", "--draft", "none", "-k", "2,4", "--suffix-history-tokens", "100"]),
    (BENCH, ["--target", "G", "--dtype", "bfloat16", "--methods", "specdecode,hf-plain"]),
]


@pytest.mark.parametrize("command,args", ACCEPTED, ids=[" ".join(c[:1] + a) for c, a in ACCEPTED])
def test_a_flag_that_works_where_it_runs_goes_on_to_the_load(models, command, args):
    result = run(models, command, *args)
    assert LOADED in result.output, result.output


def test_auto_says_when_its_choice_leaves_trees_out(models, monkeypatch, capsys):
    """--draft auto decides after the target's load: where it picks the draft model, --tree-width is said to do
    nothing there, not ignored."""
    from specdecode.cli import common
    from specdecode.pairing.draft_choice import DraftChoice

    def resolve(opts, *args, **kwargs):
        choice = DraftChoice(f"suffix+{models['D']}", models["D"], "measured to pay")
        opts.draft = choice.draft
        return choice, object()

    monkeypatch.setattr("specdecode.pairing.pair.load_target", lambda *a, **k: object())
    monkeypatch.setattr("specdecode.pairing.pair.resolve_auto_draft", resolve)
    monkeypatch.setattr("specdecode.pairing.pair.with_suffix", lambda opts, model: model)
    from specdecode.pairing.pair import ModelOptions

    opts = ModelOptions(target=models["T"], draft="auto", tree_width=3)
    common.load_pair(opts, announce=False)
    said = capsys.readouterr().err
    assert "--tree-width 3: --draft auto chose the draft model, which drafts chains" in said
    assert "--draft suffix" in said
