"""`specdecode bench` against llama.cpp (llama-cpp-python's generation, its prompt lookup, the llama-speculative
binary) and with --batch-size: the output parser on hand-written samples of the binary's printf formats, the
methods on the small real GGUF SmolLM2-135M (skipped when its package is absent), batches on the tiny models."""

from __future__ import annotations

import json
import stat
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from specdecode.bench.llamacpp_peers import SpeculativeBinary, parse_speculative_output
from specdecode.bench.workload import make_batches

SMOL = "smollm2-135m-instruct"

# examples/speculative/speculative.cpp: LOG_INF("decoded %4d tokens in %8.3f seconds, speed: %8.3f t/s\n", ...)
SPECULATIVE_OUTPUT = """\
main: n_draft = 4
 def fibonacci(n):\n    if n < 2:

encoded   27 tokens in    0.152 seconds, speed:  177.632 t/s
decoded   66 tokens in    1.901 seconds, speed:   34.719 t/s

n_draft   = 4
n_predict = 66
n_drafted = 72
n_accept  = 49
accept    = 68.056%

draft:

llama_perf_context_print:        load time =     120.31 ms
target:

llama_perf_context_print:        load time =     310.02 ms
"""
# examples/speculative-simple (older): no n_drafted nor accept line; a log prefix before each line
SIMPLE_OUTPUT = """\
0.00.412.117 I main: encoded   12 tokens in    0.050 seconds, speed:  240.000 t/s
0.02.103.551 I main: decoded   64 tokens in    1.600 seconds, speed:   40.000 t/s
0.02.103.560 I main: n_draft   = 8
0.02.103.561 I main: n_predict = 64
0.02.103.562 I main: n_accept  = 40
"""
NOTHING_DRAFTED = SPECULATIVE_OUTPUT.replace("n_drafted = 72", "n_drafted = 0").replace(
    "n_accept  = 49", "n_accept  = 0").replace("accept    = 68.056%", "accept    = -nan%")


def test_parse_speculative_output():
    run = parse_speculative_output(SPECULATIVE_OUTPUT)
    assert (run.prompt_tokens, run.new_tokens, run.n_draft, run.n_drafted, run.n_accept) == (27, 66, 4, 72, 49)
    assert run.prompt_seconds == pytest.approx(0.152) and run.decode_seconds == pytest.approx(1.901)
    assert run.seconds == pytest.approx(2.053) and run.decode_tokens_per_second == pytest.approx(34.719)
    assert run.accept_percent == pytest.approx(68.056)
    simple = parse_speculative_output(SIMPLE_OUTPUT)
    assert (simple.prompt_tokens, simple.new_tokens, simple.n_draft, simple.n_accept) == (12, 64, 8, 40)
    assert simple.n_drafted is None and simple.accept_percent is None and simple.seconds == pytest.approx(1.65)
    assert parse_speculative_output(NOTHING_DRAFTED).accept_percent is None
    with pytest.raises(ValueError, match="no 'decoded N tokens"):
        parse_speculative_output("error: failed to load model\n")


def test_make_batches_cycles_the_prompts_to_fill_the_last_batch():
    prompts = [[1], [2, 2], [3]]
    assert make_batches(prompts, 1) == [[[1]], [[2, 2]], [[3]]]
    assert make_batches(prompts, 2) == [[[1], [2, 2]], [[3], [1]]]
    assert make_batches(prompts[:1], 3) == [[[1], [1], [1]]]


def fake_speculative(tmp_path, new_flags: bool = True):
    """A stand-in for the llama-speculative binary: answers --help like it, checks that it got the GGUF files, and
    prints its end-of-run lines with the -n it was given and the draft-max as n_draft (a real build takes ~10 min)."""
    flag = "--spec-draft-n-max" if new_flags else "--draft-max"
    script = tmp_path / "llama-speculative"
    script.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env python3
        import sys
        args = sys.argv[1:]
        if "--help" in args:
            print("-md,    --model-draft FNAME\\n{flag} N\\n-fa,    --flash-attn [on|off|auto]\\n--ignore-eos")
            sys.exit(0)
        get = lambda name: args[args.index(name) + 1]
        for name in ("-m", "-md", "-f"):
            open(get(name)).close()
        n, dmax = int(get("-n")), int(get("{flag}"))
        assert get("-fa") == "on" and "--ignore-eos" in args and get("--min-p") == "0"
        print("encoded   20 tokens in    0.010 seconds, speed: 2000.000 t/s", file=sys.stderr)
        print(f"decoded {{n + 1:4d}} tokens in    0.100 seconds, speed: {{(n + 1) / 0.1:8.3f}} t/s", file=sys.stderr)
        print(f"n_draft   = {{dmax}}\\nn_predict = {{n + 1}}\\nn_drafted = 10\\nn_accept  = 7\\naccept    = 70.000%",
              file=sys.stderr)
        """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_speculative_binary_reads_its_options_from_help(tmp_path):
    new = SpeculativeBinary.find(fake_speculative(tmp_path))
    assert new.draft_max_flag == "--spec-draft-n-max" and new.flash_attn == ["-fa", "on"] and new.ignore_eos
    (tmp_path / "old").mkdir()
    old = SpeculativeBinary.find(fake_speculative(tmp_path / "old", new_flags=False))
    assert old.draft_max_flag == "--draft-max"
    with pytest.raises(FileNotFoundError, match="no such executable"):
        SpeculativeBinary.find(str(tmp_path / "missing"))


# ------------------------------------------------------------------------------------------ the real GGUF
@pytest.fixture(scope="module")
def smol_gguf():
    pytest.importorskip("llama_cpp")
    from specdecode.models import catalog, prepare

    info = catalog.get_model_info(SMOL)
    if not info.installed:
        pytest.skip(f"needs the SmolLM2 GGUF package: {info.pip_command}")
    return str(prepare.prepare_gguf(SMOL, progress=False)[0])


def test_llama_cpp_python_generation_makes_exactly_n_tokens_and_matches_our_greedy(smol_gguf):
    """llamacpp-plain's loop: n tokens, end of generation ignored, a fresh prefill each time; greedy, its tokens are
    our llama.cpp backend's greedy tokens (the backend's exact mode is llama.cpp's token-by-token decoding)."""
    import llama_cpp

    from specdecode import AutoregressiveGenerator
    from specdecode.backends.llamacpp import LlamaCppBackend
    from specdecode.bench.llamacpp_peers import LlamaCppPeers

    peers = LlamaCppPeers(smol_gguf, threads=1, n_ctx=256)
    ids = peers._llama(None).tokenize(b"def add(a, b):")
    for lookup in (None, 3):
        n, seconds = peers.generate(ids, 6, 0.0, 0, 1.0, seed=0, lookup=lookup)
        assert n == 6 and seconds > 0
        assert peers._llama(lookup).n_tokens <= len(ids) + 6 + 3  # nothing left over from an earlier call
    llm = peers._llama(None)
    llm.reset()
    theirs = [t for _, t in zip(range(6), llm.generate(ids, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, reset=False))]
    ours = AutoregressiveGenerator(LlamaCppBackend(smol_gguf, n_ctx=256, n_threads=1, max_tokens_per_forward=3))
    assert ours.generate([ids], max_new_tokens=6, temperature=0.0, ignore_eos=True).token_ids[0] == theirs
    peers.close()
    assert isinstance(llama_cpp.Llama, type)


def test_bench_llamacpp_methods_on_smollm2(smol_gguf, tmp_path):
    from specdecode.cli import app

    binary = fake_speculative(tmp_path)
    path = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "--target", SMOL, "--draft", SMOL, "--backend", "llamacpp", "--threads", "1", "-k", "auto,2",
        "--prompts", "edit", "--nb-prompts", "1", "-n", "4", "--runs", "1", "--warmup", "0", "--cost-repeats", "1",
        "--methods", "specdecode-plain,specdecode,llamacpp-plain,llamacpp-prompt-lookup",
        "--llama-speculative", binary, "--llama-draft-max", "2,3", "--json", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    assert report["config"]["llamacpp"]["target_gguf"] == smol_gguf
    assert report["config"]["llamacpp"]["threads"] == 1
    by_k = {c["k"]: c["methods"] for c in report["sweep"]}
    # llama-speculative was not in --methods as given: only the default list gains it
    assert set(by_k[2]) == {"specdecode-plain", "specdecode", "llamacpp-plain", "llamacpp-prompt-lookup"}
    for methods in by_k.values():
        for name in ("llamacpp-plain", "llamacpp-prompt-lookup"):
            assert methods[name]["tokens_per_second"] > 0 and methods[name]["new_tokens_per_prompt"] == [4]
            assert methods[name]["lengths_match"]
        assert methods["llamacpp-prompt-lookup"]["speedup_vs"]["llamacpp-plain"] > 0
    assert by_k["auto"]["specdecode"]["k_histogram"] and by_k["auto"]["specdecode"]["plain_steps"] is not None
    assert "llamacpp-plain" in result.stdout

    result = CliRunner().invoke(app, [
        "bench", "--target", SMOL, "--draft", SMOL, "--backend", "llamacpp", "--threads", "1", "-k", "2",
        "--nb-prompts", "1", "-n", "4", "--runs", "1", "--warmup", "0", "--cost-repeats", "1",
        "--llama-speculative", binary, "--llama-draft-max", "2,3", "--json", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    methods = json.loads(path.read_text())["methods"]
    assert {"llama-speculative-dmax2", "llama-speculative-dmax3", "llamacpp-plain"} <= set(methods)
    dmax3 = methods["llama-speculative-dmax3"]
    assert dmax3["new_tokens_per_prompt"] == [5] and dmax3["lengths_match"]  # it may overshoot -n
    assert dmax3["tokens_per_second"] == pytest.approx(5 / 0.11) and dmax3["acceptance_rate"] == pytest.approx(0.7)
    assert dmax3["command"][dmax3["command"].index("--spec-draft-n-max") + 1] == "3"
    assert dmax3["command"][dmax3["command"].index("-t") + 1] == "1"
    assert smol_gguf in dmax3["command"]


# ------------------------------------------------------------------------------------------ batches
def test_bench_batch_size_on_tiny_models(tiny_model_dirs, tmp_path):
    from specdecode.cli import app

    before = torch.get_num_threads()
    path = tmp_path / "batch.json"
    try:
        result = CliRunner().invoke(app, [
            "bench", "--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"], "--draft-quantize",
            "none", "--threads", "1", "-k", "2", "--nb-prompts", "3", "--batch-size", "2", "-n", "4", "--runs", "2",
            "--warmup", "0", "--cost-repeats", "1", "--json", str(path)], catch_exceptions=False)
    finally:
        torch.set_num_threads(before)
    assert result.exit_code == 0, result.output
    assert "hf-assisted left out" in result.stderr and "llamacpp-plain left out" in result.stderr
    report = json.loads(path.read_text())
    assert report["config"]["batch_size"] == 2 and report["config"]["rows_per_run"] == 4
    assert set(report["methods"]) == {"specdecode-plain", "specdecode", "hf-plain"}
    for block in report["methods"].values():
        assert block["new_tokens_per_prompt"] == [4, 4, 4, 4] and block["lengths_match"]
        for run in block["runs"]:
            assert len(run["per_prompt_seconds"]) == 2  # two generate() calls of two rows each
            assert run["tokens_per_second"] == pytest.approx(16 / sum(run["per_prompt_seconds"]))
    assert report["methods"]["specdecode"]["stats"]["num_rows"] == 2 * 2 * 2
    bad = CliRunner().invoke(app, ["bench", "--target", tiny_model_dirs["target"], "--batch-size", "0"])
    assert bad.exit_code == 1 and "--batch-size" in bad.stderr
