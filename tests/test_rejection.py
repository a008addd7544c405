"""The rejection sampler alone: exact closed-form checks and large-sample chi-square tests."""

import pytest
import torch

from reference import assert_matches
from specdecode import rejection
from specdecode.rejection import (acceptance_probability, residual_distribution, verify, verify_chen,
                                  verify_greedy, verify_leviathan)

METHODS = ["leviathan", "chen"]


def random_dist(gen, v, zeros=0, sharp=1.0):
    logits = torch.randn(v, generator=gen, dtype=torch.float64) * sharp
    if zeros:
        logits[torch.randperm(v, generator=gen)[:zeros]] = -float("inf")
    return torch.softmax(logits, dim=-1)


CASES = [
    # (p, q) pairs over small vocabularies, including disjoint supports and p == q
    ([0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4]),
    ([0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25]),
    ([0.25, 0.25, 0.25, 0.25], [0.0, 1.0, 0.0, 0.0]),
    ([0.7, 0.3, 0.0], [0.0, 0.0, 1.0]),  # disjoint: every draft is rejected
    ([0.2, 0.3, 0.5], [0.2, 0.3, 0.5]),  # identical: every draft is accepted
]


def exact_output_distribution(p, q):
    """P(first emitted token = y), in closed form from the code's own acceptance and residual functions."""
    support = q > 0
    accept = torch.zeros_like(p)
    accept[support] = acceptance_probability(p[support], q[support])
    p_reject = 1.0 - (q * accept).sum()
    return q * accept + p_reject * residual_distribution(p, q)


@pytest.mark.parametrize("p, q", CASES)
def test_closed_form_output_is_exactly_p(p, q):
    p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    torch.testing.assert_close(exact_output_distribution(p, q), p, rtol=0, atol=1e-12)


def test_closed_form_output_is_exactly_p_on_random_distributions():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        v = int(torch.randint(2, 12, (1,), generator=gen))
        p = random_dist(gen, v, zeros=trial % 3 and 1, sharp=3.0)
        q = random_dist(gen, v, zeros=trial % 2, sharp=3.0)
        torch.testing.assert_close(exact_output_distribution(p, q), p, rtol=0, atol=1e-12)


def test_acceptance_probability_is_min_one_ratio():
    p = torch.tensor([0.1, 0.5, 0.0, 0.3])
    q = torch.tensor([0.2, 0.25, 0.5, 0.3])
    assert acceptance_probability(p, q).tolist() == pytest.approx([0.5, 1.0, 0.0, 1.0])


def test_residual_is_normalised_positive_part_and_falls_back_to_p_when_empty():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    # p == q: the residual max(0, p - q) has zero mass; sampling from it would be 0/0. It must fall back to p.
    torch.testing.assert_close(residual_distribution(p, p), p)
    both = residual_distribution(torch.stack([p, p]), torch.stack([q, p]))
    torch.testing.assert_close(both, torch.stack([torch.tensor([1.0, 0.0, 0.0]), p]))
    assert not torch.isnan(both).any()


def draws_for(method, p, q, k, n, seed):
    """n independent verification steps with fresh drafts x_i ~ q_i; returns (num_accepted, emitted [n, k+1])."""
    gen = torch.Generator().manual_seed(seed)
    q_b = q.expand(n, k, -1).contiguous()
    p_b = p.expand(n, k + 1, -1).contiguous()
    drafts = torch.multinomial(q_b.reshape(n * k, -1), 1, generator=gen).reshape(n, k)
    num_accepted, next_token = verify(drafts, q_b.float(), p_b.float(), gen, method)
    emitted = torch.full((n, k + 1), -1)
    for b in range(n):
        a = int(num_accepted[b])
        emitted[b, :a] = drafts[b, :a]
        emitted[b, a] = next_token[b]
    return num_accepted, emitted


def assert_chi_square(samples, probs, min_p=1e-3):
    return assert_matches(torch.bincount(samples, minlength=len(probs)), probs, min_p=min_p)


@pytest.mark.parametrize("method", METHODS)
def test_sampled_tokens_follow_target_at_every_position(method):
    """100k+ draws: the first emitted token, the second (when emitted) and the bonus token each follow their p."""
    gen = torch.Generator().manual_seed(1)
    v, k = 6, 2
    p = torch.stack([random_dist(gen, v, sharp=1.5) for _ in range(k + 1)]).float()
    q = torch.stack([random_dist(gen, v, sharp=1.5) for _ in range(k)]).float()
    p[0, 3] = 0.0
    p[0] /= p[0].sum()  # a token the draft likes but the target forbids
    n = 100_000
    num_accepted, emitted = draws_for(method, p, q, k, n, seed=2)
    assert_chi_square(emitted[:, 0], p[0])
    assert_chi_square(emitted[num_accepted >= 1, 1], p[1])
    assert_chi_square(emitted[num_accepted == k, k], p[k])  # the bonus token after full acceptance
    # acceptance of the first draft is sum_x min(p, q) (Leviathan et al., Definition 3.1)
    alpha = torch.minimum(p[0], q[0]).sum().item()
    assert abs((num_accepted >= 1).double().mean().item() - alpha) < 4 * (alpha * (1 - alpha) / n) ** 0.5


@pytest.mark.parametrize("method", METHODS)
def test_chi_square_detects_a_sampler_that_resamples_from_p(method, monkeypatch):
    """The statistical test has power: the classic bug (resample from p, not from the residual) is caught."""
    gen = torch.Generator().manual_seed(3)
    p = torch.tensor([[0.6, 0.3, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4]])
    monkeypatch.setattr(rejection, "residual_distribution", lambda p_, q_: p_)
    _, emitted = draws_for(method, p, q, 1, 30_000, seed=4)
    with pytest.raises(AssertionError, match="chi-square|probability 0"):
        assert_chi_square(emitted[:, 0], p[0])


def test_k_zero_is_a_plain_target_sample():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[[0.1, 0.9, 0.0]]]).expand(50_000, 1, 3).contiguous()
    n, nxt = verify_leviathan(torch.zeros(50_000, 0, dtype=torch.long), p[:, :0], p, gen)
    assert n.eq(0).all()
    assert_chi_square(nxt, p[0, 0])


def test_methods_agree_on_certain_outcomes():
    """With one-hot distributions every method must take the same deterministic path."""
    v = 5
    eye = torch.eye(v)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4]])
    q = eye[drafts]  # the drafts were certain
    p = torch.stack([eye[[1, 2, 3, 0]], eye[[1, 0, 0, 0]], eye[[4, 4, 4, 2]]])
    for verifier in (verify_leviathan, verify_chen):
        n, nxt = verifier(drafts, q, p, torch.Generator().manual_seed(0))
        assert n.tolist() == [3, 1, 3]
        assert nxt.tolist() == [0, 0, 2]  # token id 0 is a valid output


def test_greedy_accepts_while_draft_equals_argmax():
    logits = torch.full((3, 4, 6), -1.0)
    target_argmax = torch.tensor([[2, 3, 0, 5], [1, 1, 1, 1], [4, 0, 2, 3]])
    logits.scatter_(2, target_argmax.unsqueeze(-1), 5.0)
    drafts = torch.tensor([[2, 3, 0], [2, 1, 1], [4, 0, 5]])
    n, nxt = verify_greedy(drafts, logits)
    assert n.tolist() == [3, 0, 2]
    assert nxt.tolist() == [5, 1, 2]


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="leviathan, chen"):
        verify(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, 2) / 2, torch.ones(1, 2, 2) / 2, None, "medusa")
