"""Rows that join with the same prompt (a request's n choices, an evaluation's k samples of one prompt) prefill it
once: the other rows start from a copy of its KV and its last logits. The answers are those of separate prefills
(bit for bit on llama.cpp, where a lone row's prefill is what each copy gets; to float tolerance on transformers),
the rows keep their order and their own random streams, and a copy can be cancelled before it joins."""

from __future__ import annotations

import numpy as np
import pytest

from specdecode import AutoregressiveGenerator, PromptLookupDrafter, SpeculativeGenerator


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _run(gen, prompts, share=True, budget=None, max_new_tokens=10, cancel=None, first_index=0, **options):
    """prompts join together (as one request's rows do: row i draws from stream (seed, first_index + i)); cancel: a
    row cancelled after the first step."""
    session = gen.session(prefill_tokens_per_step=budget)
    session.shares_prompts = session.shares_prompts and share
    rows = [session.add(gen.request(p, max_new_tokens=max_new_tokens, logprobs=2, seed_index=first_index + i,
                                    **options)) for i, p in enumerate(prompts)]
    session.step()
    if cancel is not None:
        session.cancel(rows[cancel])
    while not session.idle:
        session.step()
    return session.result()


# ---------------------------------------------------------------------------------------------- llama.cpp
def _llama(path, rows, draft=None, k=0):
    from specdecode.backends.llamacpp import EXACT_TOKENS_PER_FORWARD, LlamaCppBackend

    # the exact mode: every row's verification runs alone, so rows with equal KV compute equal numbers
    target = LlamaCppBackend(path, n_ctx=2048, max_rows=rows, n_threads=1,
                             max_tokens_per_forward=EXACT_TOKENS_PER_FORWARD)
    return SpeculativeGenerator(target, draft, num_speculative_tokens=k) if draft is not None else \
        AutoregressiveGenerator(target)


@pytest.mark.parametrize("options", [dict(temperature=0.0), dict(temperature=0.9, seed=7)])
def test_llamacpp_choices_of_one_prompt_prefill_it_once(smol_path, options):
    prompt = _tokens(300, 49000, seed=1)
    got = _run(_llama(smol_path, rows=3), [prompt] * 3, **options)
    assert got.stats.cached_prompt_tokens == 2 * len(prompt)
    assert [s.cached_tokens for s in got.row_stats] == [0, len(prompt), len(prompt)]
    solo = _llama(smol_path, rows=1)
    for i in range(3):  # row i is a lone prefill's row i: the same KV and logits, its own stream, bit for bit
        alone = _run(solo, [prompt], first_index=i, **options)
        assert got.token_ids[i] == alone.token_ids[0] and got.logprobs[i] == alone.logprobs[0]
    if options["temperature"]:
        assert len({tuple(t) for t in got.token_ids}) > 1


def test_llamacpp_mixed_prompts_keep_their_rows_and_a_prompt_lookup_draft(smol_path):
    a, b = _tokens(200, 49000, seed=2), _tokens(90, 49000, seed=3)
    prompts = [a, b, a, b, a]
    gen = _llama(smol_path, rows=5, draft=PromptLookupDrafter(), k=3)
    got = _run(gen, prompts, max_new_tokens=16, temperature=0.0)
    assert [s.cached_tokens for s in got.row_stats] == [0, 0, 200, 90, 200]
    one = {len(p): _run(_llama(smol_path, rows=1, draft=PromptLookupDrafter(), k=3), [p], max_new_tokens=16,
                        temperature=0.0) for p in (a, b)}
    assert got.token_ids == [one[len(p)].token_ids[0] for p in prompts]


def test_llamacpp_a_copy_cancelled_while_the_prompt_is_prefilled(smol_path):
    prompt = _tokens(600, 49000, seed=4)
    gen = _llama(smol_path, rows=3)
    got = _run(gen, [prompt] * 3, budget=128, cancel=1, temperature=0.0)  # 5 prefill steps: cancelled in staging
    assert got.finish_reasons[1] == "cancelled" and len(got.token_ids[1]) <= 1  # at most the first token
    solo = _run(_llama(smol_path, rows=1), [prompt], budget=128, temperature=0.0)
    assert got.token_ids[0] == got.token_ids[2] == solo.token_ids[0]
    assert gen.target.free_rows() == 3  # no sequence left behind


def test_llamacpp_copies_find_rows_when_the_prefix_cache_holds_the_spare_ones(smol_path):
    """Parked prefixes hold the backend's spare sequences: the copies' rows are made room for (evicting) up front."""
    gen = _llama(smol_path, rows=4)
    gen.set_prefix_cache(100_000)
    for seed in (5, 6):  # two finished requests park two of the four sequences
        _run(gen, [_tokens(80, 49000, seed=seed)], temperature=0.0)
    assert len(gen.prefix_cache.entries) == 2
    prompt = _tokens(150, 49000, seed=7)
    got = _run(gen, [prompt] * 3, temperature=0.0)
    assert [s.cached_tokens for s in got.row_stats] == [0, 150, 150]
    assert gen.prefix_cache.stats.evictions >= 1
    assert got.token_ids == [_run(_llama(smol_path, rows=1), [prompt], temperature=0.0).token_ids[0]] * 3


# ---------------------------------------------------------------------------------------------- transformers
def test_transformers_choices_equal_separate_prefills(tiny_pair):
    target, draft = tiny_pair
    vocab = target.config.vocab_size
    a, b = _tokens(40, vocab, seed=5), _tokens(23, vocab, seed=6)
    prompts = [a, a, b, a, b]
    for gen in (AutoregressiveGenerator(target), SpeculativeGenerator(target, draft, num_speculative_tokens=3)):
        for options in (dict(temperature=0.0), dict(temperature=0.8, seed=3)):
            got = _run(gen, prompts, max_new_tokens=12, **options)
            want = _run(gen, prompts, share=False, max_new_tokens=12, **options)
            assert [s.cached_tokens for s in got.row_stats] == [0, 40, 0, 40, 23]
            assert [s.cached_tokens for s in want.row_stats] == [0] * 5
            assert got.token_ids == want.token_ids
            for g, w in zip(got.logprobs, want.logprobs):
                assert np.allclose(g, w, atol=1e-5)


def test_generate_shares_a_repeated_prompt(tiny_pair):
    target, _ = tiny_pair
    prompt = _tokens(30, target.config.vocab_size, seed=7)
    result = AutoregressiveGenerator(target).generate([prompt] * 4, max_new_tokens=6, temperature=1.0, seed=2)
    assert result.stats.cached_prompt_tokens == 3 * len(prompt)
    assert len({tuple(t) for t in result.token_ids}) > 1  # four rows, four streams
