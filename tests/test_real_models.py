"""End to end on the real default pair (Qwen2.5-Coder 0.5B drafting for 1.5B), through the command line.

Greedy speculative decoding must give exactly the target's own greedy tokens. Run with `pytest -m real_models`;
skipped when the weights' packages are neither installed nor already converted in the cache.
"""

from __future__ import annotations

import gc
import json

import pytest
from typer.testing import CliRunner

from specdecode.cli.app import app
from specdecode.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
from specdecode.models import catalog

pytestmark = pytest.mark.real_models

PROMPT = "def quicksort(arr):\n"
NEW_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def default_pair_available():
    for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        info = catalog.get_model_info(name)
        if not info.installed and not info.cached:
            pytest.skip(f"{name} is not installed; install its weights with: {info.pip_command}")


def run_json(*args) -> dict:
    result = CliRunner().invoke(app, ["generate", PROMPT, "-n", str(NEW_TOKENS), "--ignore-eos", "--json", *args])
    gc.collect()  # free the models of this run before the next loads its own
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    [line] = result.stdout.splitlines()
    return json.loads(line)


@pytest.fixture(scope="module", params=["llamacpp", "transformers"])
def backend(request) -> str:
    if request.param == "llamacpp":
        pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs the [llamacpp] extra")
    return request.param


@pytest.fixture(scope="module")
def target_greedy(backend) -> dict:
    return run_json("--draft", "none", "--backend", backend)


@pytest.mark.parametrize("draft_quantize", ["auto", "none"])
def test_greedy_generate_gives_the_targets_own_tokens(backend, target_greedy, draft_quantize):
    """The built-in target is the default (no --target); the draft model is named, since --draft auto may choose
    the free draft where the model cannot pay on this machine. transformers: auto = an int8 draft on the CPU.
    llama.cpp: --exact-greedy (verifications of <= 3 tokens match its token-by-token decoding bit for bit). Both: a
    fixed K, so the draft is used whatever the policy would say of its cost on this CPU (under -k auto the
    acceptance and the target's forward count below would follow the machine's timings)."""
    if backend == "llamacpp" and draft_quantize == "none":
        pytest.skip("a GGUF draft runs as it is quantized: no draft quantization to vary")
    extra = ["-k", "3"] + (["--exact-greedy"] if backend == "llamacpp" else [])
    spec = run_json("--draft", DEFAULT_DRAFT, "--draft-quantize", draft_quantize, "--backend", backend, *extra)
    assert len(target_greedy["token_ids"]) == NEW_TOKENS
    assert spec["token_ids"] == target_greedy["token_ids"]
    assert spec["text"] == target_greedy["text"]
    stats = spec["stats"]
    # The draft is a real one: it gets most tokens accepted on code, so the target runs far less often.
    assert stats["acceptance_rate"] > 0.3
    assert stats["target_forward_calls"] < target_greedy["stats"]["target_forward_calls"]


def test_compare_reports_identical_greedy_outputs():
    result = CliRunner().invoke(app, ["compare", PROMPT, "-n", "16", "--ignore-eos", "--json", "--draft-quantize",
                                      "none", "--exact-greedy", "-k", "3"])
    gc.collect()
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["identical"] is True
    assert record["speculative"]["stats"]["acceptance_rate"] > 0.3
