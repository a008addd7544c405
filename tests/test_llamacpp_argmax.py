"""The llama.cpp backend's greedy fast path: a greedy step that needs no distribution asks llama.cpp for the argmax of
each position (forward_argmax, read off its output buffer) instead of its logits. It must give exactly what the
logits give: the same tokens from the backend, the same output from the engine; logprobs and samples still go through
the logits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp")

from test_registry import write_tiny_gguf  # noqa: E402

from specdecode import PromptLookupDrafter, SpeculativeGenerator  # noqa: E402
from specdecode.engine import session as session_module  # noqa: E402
from specdecode.backends.llamacpp import LlamaCppBackend  # noqa: E402
from specdecode.engine.generators import AutoregressiveGenerator  # noqa: E402
from specdecode.exact.sampling import greedy  # noqa: E402

PROMPTS = [[5, 77, 140, 9], [200, 3, 3, 41], [17, 18, 19, 20]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.parametrize("options", [{}, {"max_tokens_per_forward": 3}])
def test_forward_argmax_is_the_argmax_of_forward(tiny_gguf, options):
    """Three rows, 5 new tokens each (the exact mode cuts them into forwards of 3, a row at a time), on a vocabulary
    narrower than the model's: the same tokens and the same cache lengths as greedy(forward(...))."""
    backend = LlamaCppBackend(tiny_gguf, n_ctx=64, n_threads=1, max_rows=3, **options)
    backend.vocab_size = backend.n_vocab - 40  # a shared vocabulary narrower than the model's
    backend.reset(3)
    backend.forward(torch.tensor(PROMPTS), last_only=True)
    start = backend.lengths
    new = torch.randint(0, backend.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    logits = backend.forward(new)
    after = backend.lengths
    backend.trim(start)
    tokens = backend.forward_argmax(new)
    assert tokens.dtype == torch.long and tokens.shape == (3, 5)
    assert tokens.tolist() == greedy(logits).tolist()
    assert backend.lengths == after
    assert int(tokens.max()) < backend.vocab_size
    backend.trim(start)  # an array in (what the loop passes), an array out: the same tokens
    array = backend.forward_argmax(new.numpy())
    assert isinstance(array, np.ndarray) and array.dtype == np.int64 and array.tolist() == tokens.tolist()
    assert backend.lengths == after


def _count_argmax_calls(backend, monkeypatch) -> list[int]:
    calls = []
    own = backend.forward_argmax

    def counted(input_ids):
        calls.append(input_ids.shape[1])
        return own(input_ids)

    monkeypatch.setattr(backend, "forward_argmax", counted)
    return calls


def _without_fast_path(monkeypatch):
    real = session_module.capabilities  # what the session reads of the target, once: here without forward_argmax
    monkeypatch.setattr(session_module, "capabilities", lambda backend: replace(real(backend), forward_argmax=None))


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_output_is_the_same_with_and_without_the_fast_path(tiny_gguf, monkeypatch, k):
    target = LlamaCppBackend(tiny_gguf, n_ctx=64, n_threads=1, max_rows=3)
    generator = AutoregressiveGenerator(target) if k == 0 else SpeculativeGenerator(
        target, PromptLookupDrafter(), num_speculative_tokens=k)
    calls = _count_argmax_calls(target, monkeypatch)
    fast = generator.generate(PROMPTS, max_new_tokens=24, temperature=0.0, ignore_eos=True)
    assert calls and len(calls) == fast.stats.target_forward_calls - 1  # every step but the prefill took it
    if k:
        assert max(calls) > 1  # it verified drafts too
    with monkeypatch.context() as m:
        _without_fast_path(m)
        slow = generator.generate(PROMPTS, max_new_tokens=24, temperature=0.0, ignore_eos=True)
    assert fast.token_ids == slow.token_ids
    assert fast.stats.accepted_tokens == slow.stats.accepted_tokens


def test_logprobs_and_samples_still_read_the_logits(tiny_gguf, monkeypatch):
    target = LlamaCppBackend(tiny_gguf, n_ctx=64, n_threads=1, max_rows=3)
    generator = AutoregressiveGenerator(target)
    calls = _count_argmax_calls(target, monkeypatch)
    with_logprobs = generator.generate(PROMPTS[:1], max_new_tokens=8, temperature=0.0, ignore_eos=True,
                                       return_logprobs=2)
    sampled = generator.generate(PROMPTS[:1], max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    assert calls == []
    plain = generator.generate(PROMPTS[:1], max_new_tokens=8, temperature=0.0, ignore_eos=True)
    assert with_logprobs.token_ids == plain.token_ids
    # the logprobs are the target's own: log-softmax of its logits at each emitted position
    target.reset(1)
    logits = target.forward(torch.tensor([PROMPTS[0] + plain.token_ids[0][:-1]]))[0, len(PROMPTS[0]) - 1:]
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(plain.token_ids[0])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(with_logprobs.logprobs[0]), expected, atol=1e-5)
    assert len(with_logprobs.top_logprobs[0][0]) == 2
    with monkeypatch.context() as m:
        _without_fast_path(m)
        again = generator.generate(PROMPTS[:1], max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    assert sampled.token_ids == again.token_ids


# ---------------------------------------------------------------------------------------------- grammar rows
def test_a_masks_argmax_is_greedy_of_the_masked_scores():
    """TokenMask.argmax_of against greedy(scores + bias()): masks that allow the top token and masks that refuse it,
    ties included (the first of equal maxima wins in both)."""
    from specdecode.structured.constraints import TokenMask

    rng = np.random.default_rng(0)
    width = 301
    for trial in range(200):
        scores = rng.standard_normal(width).astype(np.float32)
        if trial % 3 == 0:
            scores[rng.integers(0, width, 5)] = scores.max()  # ties at the top
        allowed = rng.random(width) < (0.02 if trial % 2 else 0.5)
        allowed[rng.integers(0, width)] = True
        mask = TokenMask(np.packbits(allowed, bitorder="little"), width - trial % 7, width)
        expected = greedy(torch.from_numpy(scores)[None] + mask.bias()[None]).item()
        assert mask.argmax_of(scores) == expected


def test_forward_argmax_with_masks_is_greedy_of_the_masked_logits(tiny_gguf):
    from specdecode.structured.constraints import TokenMask

    backend = LlamaCppBackend(tiny_gguf, n_ctx=64, n_threads=1, max_rows=3)
    backend.reset(3)
    backend.forward(torch.tensor(PROMPTS), last_only=True)
    start = backend.lengths
    new = torch.randint(0, backend.vocab_size, (3, 4), generator=torch.Generator().manual_seed(1))
    logits = backend.forward(new)
    backend.trim(start)
    rng = np.random.default_rng(2)
    width = backend.vocab_size
    allowed = [[TokenMask(np.packbits(rng.random(width) < 0.1, bitorder="little"), width, width) for _ in range(4)],
               [None, None],  # a free row; positions past a row's list are free too
               [None, TokenMask(np.packbits(np.arange(width) == 7, bitorder="little"), width, width)]]
    bias = torch.zeros(3, 4, width)
    for b, row in enumerate(allowed):
        for j, mask in enumerate(row):
            if mask is not None:
                bias[b, j] = mask.bias()
    tokens = backend.forward_argmax(new.numpy(), allowed=allowed)
    assert tokens.tolist() == greedy(logits + bias).tolist()
    assert tokens[2, 1] == 7


@pytest.mark.parametrize("k", [0, 3])
def test_a_grammar_rows_greedy_output_is_the_same_with_and_without_the_fast_path(tiny_gguf, monkeypatch, k):
    """Constrained greedy rows take forward_argmax with their masks (no [B, K + 1, V] bias built), and give what the
    logits path gives, beside a free row."""
    from specdecode.pairing.loading import load_model

    loaded = load_model(str(tiny_gguf), backend="llamacpp", threads=1, max_rows=3)
    target = loaded.model
    generator = AutoregressiveGenerator(target, tokenizer=loaded.tokenizer) if k == 0 else SpeculativeGenerator(
        target, PromptLookupDrafter(), num_speculative_tokens=k, tokenizer=loaded.tokenizer)
    own, masked = target.forward_argmax, []

    def counted(input_ids, allowed=None):
        masked.append(allowed is not None)
        return own(input_ids, allowed=allowed)

    monkeypatch.setattr(target, "forward_argmax", counted)
    regex = ["(t|th| t| th|a|b){3,20}", "[a-c ]{4,30}", None]
    fast = generator.generate(PROMPTS, max_new_tokens=16, temperature=0.0, regex=regex)
    assert any(masked)  # the constrained steps took the fast path
    with monkeypatch.context() as m:
        _without_fast_path(m)
        slow = generator.generate(PROMPTS, max_new_tokens=16, temperature=0.0, regex=regex)
    assert fast.token_ids == slow.token_ids
    assert fast.stats.accepted_tokens == slow.stats.accepted_tokens
