"""Continuous batching in the engine: rows join between steps and leave when done, with any mix of settings;
each row's output is what it would be alone (greedy rows exactly, seeded sampled rows too)."""

import pytest
import torch

from conftest import perturbed_copy, tiny_qwen
from specdecode import PromptLookupDrafter, SpeculativeGenerator

PROMPTS = [[11, 42, 7, 99, 5], [3], [8, 8, 9, 100, 4, 4, 2, 7, 1, 6, 30, 31, 32, 33], [50, 51]]


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen(128, seed=3, eos_token_id=127)
    return target, perturbed_copy(target, 0.3, seed=4)


def run(session, arrivals: dict[int, list]):
    """Steps the session; arrivals[step] lists requests that join before that step. Returns tokens per row."""
    ids, tokens, step = [], {}, 0
    while arrivals or not session.idle:
        for request in arrivals.pop(step, []):
            ids.append(session.add(request))
        for event in session.step():
            tokens.setdefault(event.row, []).append(event.token_id)
        step += 1
    return [tokens.get(i, []) for i in ids]


@pytest.mark.parametrize("k", [2, "auto"])
def test_mixed_requests_joining_at_different_steps_equal_their_solo_runs(models, k):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=k)
    specs = [  # prompt, max_new_tokens, temperature, top_k, top_p, seed
        (PROMPTS[0], 20, 0.0, 0, 1.0, None), (PROMPTS[1], 7, 0.8, 0, 0.9, 5), (PROMPTS[2], 25, 1.2, 10, 1.0, 6),
        (PROMPTS[3], 12, 0.0, 0, 1.0, None), (PROMPTS[0], 16, 0.6, 0, 1.0, 7), (PROMPTS[2], 3, 0.0, 0, 1.0, None),
    ]
    requests = [gen.request(p, n, t, tk, tp, s, ignore_eos=True) for p, n, t, tk, tp, s in specs]
    solo = [gen.generate([p], max_new_tokens=n, temperature=t, top_k=tk, top_p=tp, seed=[s], ignore_eos=True,
                         num_speculative_tokens=k).token_ids[0] for p, n, t, tk, tp, s in specs]
    together = run(gen.session(prefill_tokens_per_step=4),
                   {0: requests[:2], 1: requests[2:3], 3: requests[3:5], 6: requests[5:]})
    assert together == solo


def test_a_long_prompt_is_prefilled_in_chunks_while_running_rows_keep_decoding(models):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    session = gen.session(prefill_tokens_per_step=3)
    first = session.add(gen.request(PROMPTS[0], 40, temperature=0.0, ignore_eos=True))
    while not session.active:  # its 5 prompt tokens take two steps
        session.step()
    long_prompt = list(range(1, 61))
    late = session.add(gen.request(long_prompt, 5, temperature=0.0, ignore_eos=True))
    steps_until_first_token = 0
    while True:
        events = session.step()
        steps_until_first_token += 1
        assert any(e.row == first for e in events) or session.rows[first].finish_reason  # never stalled
        if any(e.row == late for e in events):
            break
    assert steps_until_first_token == 20  # 60 prompt tokens, 3 per step
    while not session.idle:
        session.step()
    assert session.result([late]).token_ids[0] == gen.generate([long_prompt], max_new_tokens=5, temperature=0.0,
                                                              ignore_eos=True).token_ids[0]


def test_cancelling_a_queued_and_a_running_row(models):
    target, draft = models
    gen = SpeculativeGenerator(target, PromptLookupDrafter(), num_speculative_tokens=3)
    session = gen.session()
    a = session.add(gen.request(PROMPTS[0], 30, temperature=0.0, ignore_eos=True))
    b = session.add(gen.request(PROMPTS[1], 30, temperature=0.0, ignore_eos=True))
    session.step()
    c = session.add(gen.request(PROMPTS[2], 30, temperature=0.0, ignore_eos=True))
    session.cancel(c)
    session.cancel(a)
    session.step()
    assert [r.index for r in session.active] == [b]
    while not session.idle:
        session.step()
    result = session.result()
    assert result.finish_reasons == ["cancelled", "length", "cancelled"]
    assert len(result.token_ids[1]) == 30 and result.token_ids[2] == []


def test_an_emptied_batch_takes_new_rows(models):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    session = gen.session()
    out = run(session, {0: [gen.request(PROMPTS[0], 3, temperature=0.0, ignore_eos=True)]})
    out += run(session, {0: [gen.request(PROMPTS[3], 9, temperature=0.0, ignore_eos=True)]})
    assert out[1] == gen.generate([PROMPTS[3]], max_new_tokens=9, temperature=0.0, ignore_eos=True).token_ids[0]
    assert session.stats.num_rows == 2


def test_max_batch_makes_rows_wait_their_turn(models):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    session = gen.session(max_batch=2)
    requests = [gen.request(p, 6, temperature=0.0, ignore_eos=True) for p in PROMPTS]
    most = 0
    ids = [session.add(r) for r in requests]
    while not session.idle:
        session.step()
        most = max(most, session.running)
    assert most == 2
    solo = [gen.generate([p], max_new_tokens=6, temperature=0.0, ignore_eos=True).token_ids[0] for p in PROMPTS]
    assert session.result(ids).token_ids == solo


def test_a_row_can_fix_its_own_k_and_events_carry_the_step(models):
    """A plain row (K = 0) and a K = 5 row share a batch with an auto row; each equals its solo greedy run."""
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
    session = gen.session()
    ks = [0, 5, None]
    ids = [session.add(gen.request(PROMPTS[0], 20, temperature=0.0, ignore_eos=True, num_speculative_tokens=k))
           for k in ks]
    events = []
    while not session.idle:
        events += session.step()
    result = session.result(ids)
    solo = gen.generate([PROMPTS[0]], max_new_tokens=20, temperature=0.0, ignore_eos=True).token_ids[0]
    assert result.token_ids == [solo] * 3
    assert set(result.provenance[0]) == {"target"} and result.row_stats[0].proposed_tokens == 0
    assert max(e.num_drafts for e in events if e.row == ids[1]) == 5
    steps = [e.step for e in events if e.row == ids[0]]
    # a plain row decides one token per step; its first (from the prefill) shares a step with the next
    assert steps == sorted(steps) and len(set(steps)) == 19
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        gen.request(PROMPTS[0], 5, num_speculative_tokens=-1)


def test_rows_leave_after_a_join_that_followed_plain_steps(models, monkeypatch):
    """Regression: a row joined after a speculative step, then plain steps, then an older row finished; the
    draft's per-proposal bookkeeping was stale and leaving crashed the engine (seen in `serve` under -k auto)."""
    from specdecode.policy.choose import AdaptivePolicy

    target, draft = models
    plan = [2]
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, rows, caps: min(plan.pop(0) if plan else 0, max(caps)))
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
    requests = [gen.request(PROMPTS[0], 6, 0.0, ignore_eos=True), gen.request(PROMPTS[2], 20, 0.0, ignore_eos=True)]
    together = run(gen.session(), {0: requests[:1], 1: requests[1:]})
    plain = SpeculativeGenerator(target, None)
    assert together == [plain.generate([r.prompt], max_new_tokens=r.max_new_tokens, temperature=0.0,
                                       ignore_eos=True).token_ids[0] for r in requests]
