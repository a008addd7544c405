"""The prefix cache: a prompt that starts with tokens whose KV is held (a finished or a running row's) prefills only
the rest, and gets exactly what a cold prefill gives: the same tokens and the same log-probabilities, bit for bit,
on llama.cpp (a real GGUF, where the size of a forward changes the numbers) and on transformers; eviction under
the token budget and the backend's spare rows; rows sharing a cached prefix; cancellation; the on/off switch."""

from __future__ import annotations

import numpy as np
import pytest

from specdecode import AutoregressiveGenerator, PromptLookupDrafter, SpeculativeGenerator
from specdecode.backends.prefix_cache import MIN_REUSE, PrefixCache

RNG = np.random.default_rng(0)


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _run(gen, prompts, budget=None, max_new_tokens=8, **options):
    """Rows joining one after another (each a request of its own, as a server's), run to the end."""
    options.setdefault("temperature", 0.0)
    session = gen.session(prefill_tokens_per_step=budget)
    for p in prompts:
        session.add(gen.request(p, max_new_tokens=max_new_tokens, logprobs=2, **options))
        while session.queued:
            session.step()
    while not session.idle:
        session.step()
    return session.result()


def _assert_same(warm, cold):
    assert warm.token_ids == cold.token_ids
    assert warm.logprobs == cold.logprobs  # bit for bit: the same forwards computed the same numbers
    assert warm.top_logprobs == cold.top_logprobs


# ---------------------------------------------------------------------------------------------- llama.cpp
def _llama(path, rows=1, cache=0, draft=None, k=0):
    from specdecode.backends.llamacpp import LlamaCppBackend

    target = LlamaCppBackend(path, n_ctx=2048, max_rows=rows, n_threads=1)
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=k) if draft is not None else \
        AutoregressiveGenerator(target)
    gen.set_prefix_cache(cache)
    return gen


# below a block, across n_batch (512), across two; with a 256-token budget the first two (1100 in 256-token chunks
# repeated 530's case: 51 s of the suite)
@pytest.mark.parametrize("length, budget", [(90, None), (90, 256), (530, None), (530, 256), (1100, None)])
def test_llamacpp_cached_prefix_gives_the_cold_prefills_numbers(smol_path, length, budget):
    system = _tokens(length, 49000, seed=length)
    question = system + _tokens(int(RNG.integers(5, 90)), 49000, seed=length + 1)
    warm, cold = _llama(smol_path, rows=2, cache=100_000), _llama(smol_path)
    first = _run(warm, [system], budget)
    second = _run(warm, [question], budget)
    assert first.row_stats[0].cached_tokens == 0
    cached = second.row_stats[0].cached_tokens
    assert cached >= min(length, len(question) - 64) - 64 - 1 and cached % 64 == 0
    _assert_same(second, _run(cold, [question], budget))
    _assert_same(first, _run(cold, [system], budget))


def test_llamacpp_reusable_prefix_keeps_the_cold_runs_last_forward(smol_path):
    backend = _llama(smol_path).target
    n_batch = backend._shared.n_batch
    # with a budget a prefill's last forward starts at the prompt's last multiple of 64 (the session cuts it there)
    assert backend.reusable_prefix(930, 900, 256) == 896  # the cold run's last forward [896, 930), again
    assert backend.reusable_prefix(483, 482, 256) == 448  # a turn re-sending 482 tokens: 35 prefilled again
    assert backend.reusable_prefix(1299, 1276, 256) == 1216  # [1216, 1280) then [1280, 1299), the cold run's last
    assert backend.reusable_prefix(520, 519, None) == 512  # cold ends with [512, 520): only that forward again
    assert backend.reusable_prefix(700, 699, None) == 576  # [512, 700) cold; [576, 700) warm (>= 64 tokens)
    assert backend.reusable_prefix(700, 100, None) == 64
    assert backend.reusable_prefix(60, 59, None) == 0  # no whole block before the last token
    assert backend.reusable_prefix(700, 699, 100) == 0  # a budget off the 64-token grid: no exact reuse
    assert n_batch == 512


def test_llamacpp_sampled_rows_and_a_draft_stay_the_same_with_the_cache(smol_path):
    system = _tokens(400, 49000, seed=3)
    question = system + _tokens(20, 49000, seed=4)
    options = dict(temperature=0.9, seed=11)
    warm = _llama(smol_path, rows=3, cache=100_000, draft=PromptLookupDrafter(), k=3)
    cold = _llama(smol_path, rows=2, draft=PromptLookupDrafter(), k=3)
    _run(warm, [system], **options)
    second = _run(warm, [question], max_new_tokens=24, **options)
    assert second.row_stats[0].cached_tokens >= 320
    _assert_same(second, _run(cold, [question], max_new_tokens=24, **options))


def test_llamacpp_model_draft_takes_its_prefix_from_its_own_cache(smol_path):
    from specdecode.backends.llamacpp import LlamaCppBackend
    from specdecode.drafters import ModelDrafter

    def gen(rows, cache):
        draft = ModelDrafter(LlamaCppBackend(smol_path, n_ctx=2048, max_rows=rows, n_threads=1))
        return _llama(smol_path, rows=rows, cache=cache, draft=draft, k=3)

    system = _tokens(500, 49000, seed=8)
    question = system + _tokens(30, 49000, seed=9)
    options = dict(temperature=0.8, seed=5, max_new_tokens=16)
    warm, cold = gen(2, 100_000), gen(1, 0)
    _run(warm, [system], **options)
    second = _run(warm, [question], **options)
    assert warm.drafter.prefix_cache.stats.hit_tokens >= 448 and second.row_stats[0].cached_tokens >= 448
    assert second.stats.proposed_tokens > 0
    _assert_same(second, _run(cold, [question], **options))


def _spied_draft(smol_path, rows: int, cache: int):
    """A K = 3 generator whose model draft records the logits of every draft forward (its q, before warping)."""
    from specdecode.backends.llamacpp import LlamaCppBackend
    from specdecode.drafters import ModelDrafter

    backend = LlamaCppBackend(smol_path, n_ctx=2048, max_rows=rows, n_threads=1)
    forward, seen = backend.forward, []

    def spy(ids, valid=None, last_only=False, output_hidden=False):
        logits = forward(ids, valid, last_only=last_only, output_hidden=output_hidden)
        seen.append((ids.shape[1], logits[:, -1].clone()))
        return logits

    backend.forward = spy
    return _llama(smol_path, rows=rows, cache=cache, draft=ModelDrafter(backend), k=3), seen


@pytest.mark.parametrize("case", ["multiple of 64", "answer re-sent"])
def test_llamacpp_model_draft_gives_the_cold_q_from_its_cache(smol_path, case):
    """The draft's own cache: a prompt of 128 tokens (a multiple of 64) that a parked prompt holds whole, and a
    prompt that re-sends an earlier answer (the draft's KV of it came from one-token draft steps: not lent). Every
    draft forward's logits, and so q and the seeded text, are bit for bit a cold run's."""
    import torch

    options = dict(temperature=1.0, seed=4)
    (warm, warm_q), (cold, cold_q) = _spied_draft(smol_path, 2, 100_000), _spied_draft(smol_path, 1, 0)
    first = _tokens(160 if case == "multiple of 64" else 100, 49000, seed=6)
    answer = _run(warm, [first], max_new_tokens=50, **options).token_ids[0]
    prompt = first[:128] if case == "multiple of 64" else first + answer[:40] + _tokens(60, 49000, seed=7)
    warm_q.clear()
    got, want = _run(warm, [prompt], max_new_tokens=12, **options), _run(cold, [prompt], max_new_tokens=12, **options)
    assert warm.drafter.prefix_cache.stats.hit_tokens == 64  # 128 - 64 >= 64 tokens left; the answer not lent
    assert [n for n, _ in warm_q[1:]] == [n for n, _ in cold_q[1:]]  # after the catch-up, the same forwards
    assert len(warm_q) == len(cold_q) and all(torch.equal(a, b) for (_, a), (_, b) in zip(warm_q, cold_q))
    _assert_same(got, want)


def test_llamacpp_rows_share_a_running_rows_prefix_and_parked_ones(smol_path):
    system = _tokens(300, 49000, seed=5)
    prompts = [system + _tokens(10 + i, 49000, seed=10 + i) for i in range(3)]
    warm, cold = _llama(smol_path, rows=4, cache=100_000), _llama(smol_path, rows=1)
    session = warm.session()
    rows = []
    for p in prompts:  # each joins while the ones before it are still decoding
        rows.append(session.add(warm.request(p, max_new_tokens=30, temperature=0, logprobs=1)))
        session.step()
    while not session.idle:
        session.step()
    result = session.result(rows)
    assert result.row_stats[0].cached_tokens == 0
    assert [s.cached_tokens for s in result.row_stats[1:]] == [192, 192]  # copied from a running row (310 tokens: the last forward keeps >= 64)
    for i, p in enumerate(prompts):
        alone = _run(cold, [p], max_new_tokens=30, temperature=0)
        assert result.token_ids[i] == alone.token_ids[0] and result.logprobs[i] == alone.logprobs[0]


def test_llamacpp_eviction_frees_sequences_and_respects_the_budget(smol_path):
    gen = _llama(smol_path, rows=3, cache=700)  # one running row, two spare sequences
    a, b, c = (_tokens(300, 49000, seed=s) for s in (20, 21, 22))
    _run(gen, [a])
    _run(gen, [b])
    cache = gen.prefix_cache
    assert len(cache.entries) == 2 and cache.tokens == 614  # prompt and answer but its last token (never fed)
    _run(gen, [c])  # no spare sequence left for a third row, and 924 tokens > 700: the oldest goes
    assert len(cache.entries) == 2 and cache.stats.evictions == 1 and cache.tokens <= 700
    assert _run(gen, [a + [5] * 70]).row_stats[0].cached_tokens == 0  # evicted
    assert _run(gen, [c + [5] * 70]).row_stats[0].cached_tokens == 256
    one = _llama(smol_path, rows=1, cache=100_000)  # no spare sequence: a hit has to give way to the new row
    _run(one, [a])
    assert _run(one, [a + [5] * 70]).row_stats[0].cached_tokens == 0
    small = _llama(smol_path, rows=2, cache=200)
    _run(small, [a])
    assert small.prefix_cache.tokens == 0  # longer than the whole budget: not kept


def test_llamacpp_a_prefix_never_reaches_into_an_answer(smol_path):
    """A later turn re-sends an answer: its KV came from one-token decode steps, which a cold prefill computes in
    larger forwards with other numbers, so only the earlier prompt is reused (a parked row's and a running one's)."""
    system = _tokens(100, 49000, seed=90)
    answer = _run(_llama(smol_path), [system], max_new_tokens=50).token_ids[0]
    question = system + answer + _tokens(50, 49000, seed=91)  # 200 tokens: a cold prefill's one forward
    warm, cold = _llama(smol_path, rows=2, cache=100_000), _llama(smol_path)
    _run(warm, [system], max_new_tokens=50)  # parks 149 tokens; [128, 149) was decoded
    second = _run(warm, [question], max_new_tokens=20)
    assert second.row_stats[0].cached_tokens == 64  # the prompt's 100 tokens, in whole 64-token blocks
    _assert_same(second, _run(cold, [question], max_new_tokens=20))
    busy = _llama(smol_path, rows=2, cache=100_000)
    session = busy.session()
    first = session.add(busy.request(system, max_new_tokens=50, temperature=0))
    while len(session.rows[first].tokens) < 45:  # a running row holds the prompt and most of the answer
        session.step()
    question = system + answer[:40] + _tokens(60, 49000, seed=93)
    row = session.add(busy.request(question, max_new_tokens=8, temperature=0, logprobs=2))
    while not session.idle:
        session.step()
    running = session.result([row])
    assert running.row_stats[0].cached_tokens == 64
    _assert_same(running, _run(cold, [question]))


def test_llamacpp_a_request_that_ends_at_its_first_token_parks_its_prompt(smol_path):
    system = _tokens(300, 49000, seed=92)
    warm, cold = _llama(smol_path, rows=2, cache=100_000), _llama(smol_path)
    _run(warm, [system], max_new_tokens=1)
    assert warm.prefix_cache.tokens == 300  # the prompt's KV, kept (the first token was never fed)
    again = _run(warm, [system], max_new_tokens=4)
    assert again.row_stats[0].cached_tokens == 192  # [192, 300) is >= 64 tokens, as the cold [0, 300)
    _assert_same(again, _run(cold, [system], max_new_tokens=4))


def test_llamacpp_cancelled_rows_leave_the_cache_usable(smol_path):
    gen, cold = _llama(smol_path, rows=3, cache=100_000), _llama(smol_path)
    system = _tokens(600, 49000, seed=30)
    _run(gen, [system])
    session = gen.session(prefill_tokens_per_step=128)  # the copy happens, then the prefill takes steps
    row = session.add(gen.request(system + [7, 8, 9], max_new_tokens=8, temperature=0))
    session.step()
    session.cancel(row)
    while not session.idle:
        session.step()
    assert session.result([row]).finish_reasons == ["cancelled"]
    question = system + [10, 11]
    _assert_same(_run(gen, [question], temperature=0), _run(cold, [question], temperature=0))


# ---------------------------------------------------------------------------------------------- transformers
def test_transformers_cached_prefix_equals_a_cold_prefill(tiny_pair):
    target, _ = tiny_pair
    vocab = target.config.vocab_size
    warm, cold = AutoregressiveGenerator(target), AutoregressiveGenerator(target)
    warm.set_prefix_cache(10_000)
    system = _tokens(120, vocab, seed=40)
    questions = [system + _tokens(9, vocab, seed=41), system[:80] + _tokens(30, vocab, seed=42)]
    _run(warm, [system], temperature=0)
    for q in questions:
        got = _run(warm, [q], temperature=0.8, seed=3)
        assert got.row_stats[0].cached_tokens >= 80
        want = _run(cold, [q], temperature=0.8, seed=3)
        assert got.token_ids == want.token_ids
        assert np.allclose(got.logprobs[0], want.logprobs[0], atol=1e-5)


def _speculative_pair(tiny_pair):
    """(warm, cold, vocab): K = 3 generators on the tiny pair, with and without the prefix cache."""
    target, draft = tiny_pair
    warm = SpeculativeGenerator(target, draft, num_speculative_tokens=3, prefix_cache_tokens=10_000)
    return warm, SpeculativeGenerator(target, draft, num_speculative_tokens=3), target.config.vocab_size


def test_transformers_draft_cache_and_sampled_rows(tiny_pair):
    warm, cold, vocab = _speculative_pair(tiny_pair)
    system = _tokens(100, vocab, seed=70)
    warm.generate([system], max_new_tokens=4, temperature=0.8, seed=1)
    prompt = system + _tokens(7, vocab, seed=71)
    got = warm.generate([prompt], max_new_tokens=20, temperature=0.8, seed=2)
    assert warm.drafter.prefix_cache.stats.hit_tokens >= 100 and got.row_stats[0].cached_tokens >= 100
    assert got.token_ids == cold.generate([prompt], max_new_tokens=20, temperature=0.8, seed=2).token_ids


def test_transformers_batch_with_and_without_hits(tiny_pair):
    warm, cold, vocab = _speculative_pair(tiny_pair)
    system = _tokens(64, vocab, seed=50)
    warm.generate([system], max_new_tokens=4, temperature=0)
    prompts = [system + [5, 6], _tokens(20, vocab, seed=51), system[:40] + [9] * 5]
    got = warm.generate(prompts, max_new_tokens=12, temperature=0)
    assert [s.cached_tokens for s in got.row_stats] == [64, 0, 40]
    assert got.stats.cached_prompt_tokens == 104
    assert got.token_ids == cold.generate(prompts, max_new_tokens=12, temperature=0).token_ids


def test_transformers_lends_only_prompts_and_parks_rows_that_end_at_once(tiny_pair):
    """One-token forwards round otherwise than a prefill's on the CPU (a matrix-vector product, one query's
    attention): an answer's KV is not lent. A row that ends at its first token parks its prompt."""
    target, _ = tiny_pair
    vocab = target.config.vocab_size
    warm, cold = AutoregressiveGenerator(target), AutoregressiveGenerator(target)
    warm.set_prefix_cache(10_000)
    system = _tokens(40, vocab, seed=45)
    warm.generate([system], max_new_tokens=1)
    assert warm.prefix_cache.tokens == 40
    again = warm.generate([system + [5, 6]], max_new_tokens=12, temperature=0)
    assert again.row_stats[0].cached_tokens == 40
    question = system + [5, 6] + again.token_ids[0] + [7, 8]
    got = warm.generate([question], max_new_tokens=8, temperature=0)
    assert got.row_stats[0].cached_tokens == 42  # the prompt before, not the answer's 11 fed tokens
    assert got.token_ids == cold.generate([question], max_new_tokens=8, temperature=0).token_ids


def test_copies_of_kv_are_bounded_in_bytes(tiny_pair):
    target, _ = tiny_pair
    gen = AutoregressiveGenerator(target)
    gen.set_prefix_cache(10_000)
    prompts = [_tokens(60, target.config.vocab_size, seed=s) for s in (80, 81, 82)]
    gen.generate([prompts[0]], max_new_tokens=2)
    one = gen.prefix_cache.bytes
    assert one > 0
    gen.prefix_cache.max_bytes = 2 * one + one // 2
    for p in prompts[1:]:
        gen.generate([p], max_new_tokens=2)
    assert len(gen.prefix_cache.entries) == 2 and gen.prefix_cache.stats.evictions == 1


def test_the_switch_and_bad_values(tiny_pair):
    target, _ = tiny_pair
    gen = AutoregressiveGenerator(target)
    assert gen.prefix_cache is None  # off unless asked for
    system = _tokens(50, target.config.vocab_size, seed=60)
    gen.generate([system], max_new_tokens=2)
    assert gen.generate([system + [3]], max_new_tokens=2).row_stats[0].cached_tokens == 0
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        SpeculativeGenerator(target, None, prefix_cache_tokens=-1)


def test_index_matches_the_longest_prefix_and_drops_what_a_new_entry_extends():
    class Backend:  # forwards of any size give the same numbers: any prefix but the last token is reusable
        def free_rows(self):
            return 10

        def kv_ref(self, row):
            return f"row {row}"

        park = load_prefixes = free_rows

    cache, backend = PrefixCache(max_tokens=100), Backend()
    cache.insert(list(range(30)), "a")
    cache.insert(list(range(40)), "b")  # extends "a": "a" goes
    cache.insert([1] * 20, "c")
    assert [e.handle for e in cache.entries] == ["b", "c"]
    assert cache.lookup(backend, list(range(35)) + [99], [], None) == ("b", 35)
    assert cache.lookup(backend, list(range(MIN_REUSE - 2)) + [99], [], None) is None  # too short to pay
    assert cache.lookup(backend, [1] * 25, [], None) == ("c", 20)
    cache.insert([2] * 50, "d")  # 40 + 20 + 50 > 100: the least recently used goes
    assert [e.handle for e in cache.entries] == ["c", "d"] and cache.stats.evictions == 1
    cache.record(36, 35)
    assert cache.stats.to_dict()["hit_rate"] == 35 / 36
    cache.insert(list(range(100, 160)), "e", exact=30)  # 60 tokens held, the first 30 prefilled
    assert cache.lookup(backend, list(range(100, 150)) + [99], [], None) == ("e", 30)
    cache.insert(list(range(100, 170)), "f", exact=40)  # lends more of the same tokens: "e" goes
    assert "e" not in [e.handle for e in cache.entries]
    assert cache.lookup(backend, list(range(100, 150)) + [99], [(list(range(100, 150)), 45)], None) == ("row 0", 45)
    cache.insert(list(range(200, 260)), "g", exact=MIN_REUSE - 1)  # too little to lend: not kept
    assert "g" not in [e.handle for e in cache.entries]


def test_the_bounds_hold_at_every_moment_a_reader_may_look():
    """The metrics thread reads tokens and bytes while the worker inserts: room is made before an entry goes in, so
    no reading ever exceeds max_tokens or max_bytes (a soak's scrape caught 65586 of 65536 when the entry came first)."""
    class Handle:
        def __init__(self, nbytes):
            self.nbytes = nbytes

    seen = []

    class Watched(list):  # what a reader would see right after each entry goes in
        def append(self, item):
            super().append(item)
            seen.append((cache.tokens, cache.bytes))

    class Cache(PrefixCache):
        def __setattr__(self, name, value):  # insert rebuilds the list: keep watching the new one
            super().__setattr__(name, Watched(value) if name == "entries" else value)

    cache = Cache(max_tokens=100, max_bytes=1000, answers="prefill")
    for i in range(12):
        cache.insert([i] * (30 + 7 * (i % 3)), Handle(200 + 100 * (i % 4)))
    assert len(seen) == 12 and all(tokens <= 100 and nbytes <= 1000 for tokens, nbytes in seen), seen
    cache.insert([99] * 40, Handle(2000))  # over the byte bound on its own: not kept, nothing else evicted for it
    assert all(len(e.tokens) != 40 or e.tokens[0] != 99 for e in cache.entries)
    entry = cache.entries[-1]
    entry.render = lambda: [7] * 95  # re-rendered longer: the others make room before it grows
    before = cache.stats.evictions
    cache._retarget(entry)
    assert cache.tokens <= 100 and cache.entries == [entry] and cache.stats.evictions > before
