"""The exact mode past llama.cpp's split attention: from position 256 on, with 2 or more threads, a one-token step of
llama.cpp (0.3.36, CPU, flash attention) splits its attention over the KV cells between the threads and merges their
partial softmaxes, which no forward of 2+ tokens does. The exact mode feeds one token per forward there, and the
session drafts nothing a verification would then pay a forward per token for.

A real GGUF (SmolLM2-135M, from the [test] extra) on 2 threads; the reference is llama-cpp-python's own greedy
decoding on 2 threads. The other llama.cpp tests run on one thread, where no split happens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")

from test_llamacpp import llama_greedy  # noqa: E402

from specdecode import PromptLookupDrafter, SpeculativeGenerator  # noqa: E402
from specdecode.backends.llamacpp import LlamaCppBackend  # noqa: E402
from specdecode.backends.llamacpp_layout import SPLIT_ATTENTION_FROM, chunks  # noqa: E402

N_CTX = 512
THREADS = 2
# A prompt that ends 16 tokens before the split, so every continuation crosses it; a repeated text, so that prompt
# lookup's drafts are kept and a verification would hold several tokens.
TEXT = "def area(width, height):\n    return width * height\n\n"


@pytest.fixture(scope="module")
def make(smol_path):
    def backend(**options):
        return LlamaCppBackend(smol_path, **{"n_ctx": N_CTX, "n_threads": THREADS, **options})
    return backend


@pytest.fixture(scope="module")
def reference_llama(smol_path):
    return llama_cpp.Llama(str(smol_path), n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS,
                           flash_attn=True, verbose=False)


@pytest.fixture(scope="module")
def prompt(reference_llama):
    ids = reference_llama.tokenize(TEXT.encode()) * 30
    return ids[: SPLIT_ATTENTION_FROM - 16]


def token_by_token(backend, prompt, continuation) -> torch.Tensor:
    backend.reset(1)
    backend.forward(torch.tensor([prompt]), last_only=True)
    return torch.cat([backend.forward(torch.tensor([[t]]))[0] for t in continuation])


def in_one_forward(backend, prompt, continuation) -> torch.Tensor:
    backend.reset(1)
    backend.forward(torch.tensor([prompt]), last_only=True)
    return backend.forward(torch.tensor([continuation]))[0]


def test_chunks_feed_one_token_per_forward_from_the_split_on():
    pos = np.arange(250, 262, dtype=np.int32)
    rows = np.zeros(len(pos), dtype=np.int64)
    parts = chunks(rows, pos, False, 512, 3, single_from=256)
    assert [(p.start, p.stop) for p in parts] == [(0, 3), (3, 6), *((i, i + 1) for i in range(6, 12))]
    assert len(chunks(rows, pos, False, 512, 3)) == 4  # without the rule: by 3
    assert len(chunks(rows, pos, True, 512, 3, single_from=256)) == 1  # a prefill is never cut for it
    assert len(chunks(rows, pos, False, 512, None, single_from=256)) == 1  # nor the unsplit mode


def test_only_the_exact_mode_on_two_threads_has_the_rule(make, smol_path):
    assert make(max_tokens_per_forward=3).single_token_from == SPLIT_ATTENTION_FROM
    assert make().single_token_from is None
    one_thread = LlamaCppBackend(smol_path, n_ctx=N_CTX, n_threads=1, max_tokens_per_forward=3)
    assert one_thread.single_token_from is None  # one thread: one chunk, the same sums as a longer forward


def test_the_exact_mode_is_token_by_token_across_the_split_and_chunks_of_3_alone_are_not(make, reference_llama,
                                                                                           prompt):
    continuation = llama_greedy(reference_llama, prompt, 40)
    reference = token_by_token(make(), prompt, continuation)
    assert torch.equal(in_one_forward(make(max_tokens_per_forward=3), prompt, continuation), reference)
    # The rule is what makes it so: chunks of 3 everywhere part from token-by-token decoding past the split only.
    unruled = make(max_tokens_per_forward=3)
    unruled.single_token_from = None
    got = in_one_forward(unruled, prompt, continuation)
    before = SPLIT_ATTENTION_FROM - len(prompt)
    assert torch.equal(got[:before], reference[:before])
    assert not torch.equal(got[before:], reference[before:])


@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_speculation_across_the_split_equals_llama_cpp_pythons_own(make, reference_llama, prompt, k):
    n = 48
    expected = llama_greedy(reference_llama, prompt, n)
    generator = SpeculativeGenerator(make(max_tokens_per_forward=3), PromptLookupDrafter(), num_speculative_tokens=k)
    result = generator.generate([prompt], max_new_tokens=n, temperature=0.0, ignore_eos=True)
    assert result.token_ids[0] == expected
    stats = result.stats
    # it speculated before the split and not past it: every position from the split on took a forward of its own
    past = len(prompt) + n - SPLIT_ATTENTION_FROM
    assert stats.accepted_tokens > 0 and stats.target_forward_calls < n
    assert stats.target_forward_calls >= past
    assert stats.k_histogram.get(0, 0) >= past - 1


def test_token_trees_in_the_exact_mode_across_the_split_are_plain_decoding_bit_for_bit(make):
    """Trees (one KV stream shared by the rows, rejected branches' cells held for a while) before the split, single
    tokens after it: tokens and logprobs are plain decoding's on 2 threads."""
    from specdecode import AutoregressiveGenerator, SuffixDrafter, SuffixHistory

    prompt = [1000 + (i * 7) % 300 for i in range(SPLIT_ATTENTION_FROM - 20)]
    plain = AutoregressiveGenerator(make()).generate([prompt], max_new_tokens=48, temperature=0.0,
                                                     ignore_eos=True, return_logprobs=0)
    greedy = plain.token_ids[0]
    history = SuffixHistory()
    for j in range(0, 40, 4):  # branch points whose more frequent continuation is wrong: trees keep the other one
        history.add(prompt + greedy[:j] + [(greedy[j] + 7) % 40000])
    history.add(prompt + greedy)
    target = make(token_trees=True, max_tokens_per_forward=3)
    gen = SpeculativeGenerator(target, SuffixDrafter(history, tree_width=3), num_speculative_tokens=5)
    result = gen.generate([prompt], max_new_tokens=48, temperature=0.0, ignore_eos=True, return_logprobs=0)
    assert result.token_ids[0] == greedy
    assert result.logprobs[0] == plain.logprobs[0]
    assert result.stats.accepted_tokens > 0
