"""The rejection sampler alone: exact closed-form checks and large-sample chi-square tests."""

import pytest
import torch

from reference import assert_matches
from specdecode.exact import rejection
from specdecode.exact.rejection import (acceptance_probability, residual_distribution, verify, verify_chen,
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


# ------------------------------------------------------------------------- deterministic drafts (q = None)
def exact_output_deterministic(p, x):
    """P(first emitted token = y) when the draft x was chosen deterministically: keep x w.p. p(x), else residual."""
    out = torch.zeros_like(p)
    out[x] = p[x]
    return out + (1 - p[x]) * rejection.one_hot_residual(p, torch.tensor(x))


@pytest.mark.parametrize("p", [[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
def test_closed_form_deterministic_draft_output_is_exactly_p(p):
    p = torch.tensor(p, dtype=torch.float64)
    for x in range(len(p)):
        torch.testing.assert_close(exact_output_deterministic(p, x), p, rtol=0, atol=1e-12)
        # the same as the general rule with a one-hot q
        q = torch.nn.functional.one_hot(torch.tensor(x), len(p)).double()
        torch.testing.assert_close(rejection.one_hot_residual(p, torch.tensor(x)), residual_distribution(p, q))


@pytest.mark.parametrize("method", METHODS)
def test_deterministic_drafts_follow_target_without_a_dense_q(method):
    gen = torch.Generator().manual_seed(5)
    v, k, n = 6, 3, 60_000
    p = torch.stack([random_dist(gen, v, sharp=1.5) for _ in range(k + 1)]).float()
    drafts = torch.tensor([[int(p[i].argmax()) if i != 1 else 4 for i in range(k)]]).expand(n, k)
    num_accepted, next_token = verify(drafts, None, p.expand(n, k + 1, v).contiguous(), gen, method)
    first = torch.where(num_accepted > 0, drafts[:, 0], next_token)
    assert_chi_square(first, p[0])
    second = torch.where(num_accepted > 1, drafts[:, 1], next_token)[num_accepted >= 1]
    assert_chi_square(second, p[1])
    # acceptance of the first draft is p(x), as with a one-hot q
    rate = (num_accepted >= 1).double().mean().item()
    assert abs(rate - p[0, drafts[0, 0]].item()) < 4 * (0.25 / n) ** 0.5


@pytest.mark.parametrize("method", METHODS)
def test_rows_propose_their_own_number_of_drafts(method):
    """num_drafts[b] < K: row b's later drafts are ignored and its bonus comes right after its own drafts."""
    v, k = 5, 3
    eye = torch.eye(v, dtype=torch.float64)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    q = eye[drafts]
    p = eye[[1, 2, 3, 4]].expand(3, k + 1, v).contiguous()  # the target agrees with every draft
    n, nxt = verify(drafts, q, p, torch.Generator().manual_seed(0), method, num_drafts=[3, 1, 0])
    assert n.tolist() == [3, 1, 0]
    assert nxt.tolist() == [4, 2, 1]  # the bonus token at each row's own next position
    n, nxt = verify_greedy(drafts, torch.log(p.clamp(min=1e-9)), num_drafts=[3, 1, 0])
    assert n.tolist() == [3, 1, 0] and nxt.tolist() == [4, 2, 1]


def test_uniforms_decide_like_a_generator_would():
    """Pre-drawn per-row uniforms: u[:, i] accepts draft i, u[:, K] draws the next token."""
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    drafts = torch.tensor([[0]])
    keep = verify_leviathan(drafts, q, p, torch.tensor([[0.49, 0.3]], dtype=torch.float64))
    assert keep[0].tolist() == [1] and keep[1].tolist() == [2]
    reject = verify_leviathan(drafts, q, p, torch.tensor([[0.51, 0.3]], dtype=torch.float64))
    assert reject[0].tolist() == [0] and reject[1].tolist() == [1]  # the residual is all on token 1


def test_greedy_acceptance_on_lists_is_the_tensor_rule():
    """The llama.cpp greedy fast path accepts on host lists (accept_greedy_lists): the same counts and next tokens as
    accept_greedy on tensors, rows of different widths included (a row's drafts past its width are ignored)."""
    gen = torch.Generator().manual_seed(0)
    for k in range(4):
        drafts = torch.randint(0, 3, (6, k), generator=gen)
        target = torch.randint(0, 3, (6, k + 1), generator=gen)
        target[0, :k] = drafts[0]  # a row that keeps every draft
        widths = torch.randint(0, k + 1, (6,), generator=gen).tolist()
        accepted, tokens = rejection.accept_greedy(drafts, target, widths)
        assert rejection.accept_greedy_lists(drafts.tolist(), target.tolist(), widths) == \
            (accepted.tolist(), tokens.tolist())
