"""A draft of another tokenizer on the real models: SmolLM2-135M-Instruct (49k-token BPE) drafting for the default
target, Qwen2.5-Coder-1.5B-Instruct (152k-token BPE). Greedy speculative decoding must give exactly the target's own
greedy tokens on every prompt, on both backends (llama.cpp in its exact mode, whose forwards run one row at a time,
so a batch decodes each row as it would alone). Run with `pytest -m real_models`; skipped where the weights'
packages are not installed."""

from __future__ import annotations

import gc

import pytest

from specdecode import AutoregressiveGenerator, SpeculativeGenerator, load_model
from specdecode.drafters import CrossVocabDrafter
from specdecode.models import catalog

pytestmark = pytest.mark.real_models

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"
NEW_TOKENS = 6
# Code and prose; several end inside a word, after an opening bracket or a space, or in non-ASCII text, where the
# draft's text meets a row that ends inside one of the target's tokens.
PROMPTS = [
    "def quicksort(arr):\n", "def quicks", "import numpy as np\n\ndef moving_average(x, w):\n", "for i in range(",
    "class Stack:\n    def __init__(self):\n        self.", "def fib(n):\n    if n < 2:\n        return n\n    return ",
    "with open('data.csv') as f:\n    rows = [line.split(',') for line in f", "SELECT name, COUNT(*) FROM users WHE",
    "#include <stdio.h>\n\nint main(void) {\n    printf(", "const add = (a, b) =>", "x = {'a': 1, 'b': [",
    "def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is prime.\"\"\"\n", "    return sorted(items, key=lambda",
    "fn main() {\n    let v: Vec<i32> = ", "The capital of France is", "Once upon a time, in a small vill",
    "The quick brown fox jumps over the lazy", "Speculative decoding is a technique that", "Dear Sir or Madam,\n\n",
    "In 1969, the first humans landed on the", "Le café est très ", "Water boils at 100 degrees Cel",
    "Here is a list of fruits:\n1. Apple\n2.", "The theory of relativity was developed by Albert",
    "To be, or not to be, that is the", "Photosynthesis converts sunlight into", "The mitochondria is the power",
    "# Title\n\nThis document describes how to insta", "Q: What is 12 times 12?\nA:", "日本の首都は",
    "In summary, the results show that ", "Error: file not fou",
]


@pytest.fixture(scope="module", autouse=True)
def models_installed():
    for name in (TARGET, DRAFT):
        info = catalog.get_model_info(name)
        if not info.installed and not info.cached:
            pytest.skip(f"{name} is not installed; install its weights with: {info.pip_command}")


@pytest.mark.parametrize("backend", ["llamacpp", "transformers"])
def test_a_draft_of_another_tokenizer_gives_the_targets_own_greedy_tokens(backend):
    if backend == "llamacpp":
        pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs the [llamacpp] extra")
    rows = len(PROMPTS) + 1
    # 33 short rows: small caches; one thread, as the suite's other llama.cpp tests (its threads spin while they wait
    # for each other, which costs several times the step when another process shares the cores)
    small = {"backend_options": {"n_ctx": 256}, "threads": 1} if backend == "llamacpp" else {}
    target = load_model(TARGET, backend=backend, exact_greedy=True, max_rows=rows, **small)
    draft = load_model(DRAFT, backend=backend, max_rows=rows, **small)
    try:
        plain = AutoregressiveGenerator(target).generate(PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                        ignore_eos=True)
        gen = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
        assert isinstance(gen.drafter, CrossVocabDrafter)  # bridged: no VocabularyMismatchError
        spec = gen.generate(PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        for prompt, mine, theirs in zip(PROMPTS, spec.token_ids, plain.token_ids):
            assert mine == theirs, prompt
        assert spec.texts == plain.texts
        assert spec.stats.acceptance_rate > 0.2  # a real draft: its text is often the target's
    finally:
        del target, draft
        gc.collect()
