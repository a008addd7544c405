"""The modified rejection sampler of speculative decoding: pure tensor math, no models.

Given K draft tokens x_1..x_K drawn from the draft's distributions q_1..q_K, and the target's
distributions p_1..p_{K+1} at the same positions (plus one more), keep x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw from normalize(max(0, p_i - q_i)); if all K are
kept, draw a bonus token from p_{K+1}. Every emitted token is then distributed exactly as the target's
(Leviathan et al. 2023, Theorem 1; Chen et al. 2023, Theorem 1).

Shapes: draft_tokens [B, K] (int64), q [B, K, V] or None, p [B, K+1, V]. q=None means the drafts were chosen
deterministically (prompt lookup, n-grams): q is then one-hot at x, so x is kept with probability p(x) and a
rejection resamples from p with x removed, and no [B, K, V] tensor is ever built.
`num_drafts` [B] (optional) is how many of the K drafts row b really proposes: a row's later drafts are ignored
and its bonus comes from p_{num_drafts[b]+1}. Randomness is either a torch.Generator (one stream for the batch) or
uniforms [B, K+1] drawn from each row's own stream: u[:, i] decides draft i, u[:, K] draws the final token.
Each verifier returns (num_accepted [B] int64, next_token [B] int64).
"""

from __future__ import annotations

import torch

from .sampling import greedy, sample_with_uniforms

METHODS = ("leviathan", "chen")


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for tokens x drawn from q (so q(x) > 0)."""
    return torch.clamp(p_x / q_x, max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) over the last dim; where that has zero mass (p == q), p itself.

    A rejection cannot happen when p == q, but float round-off can still make the residual vanish; p is then
    the distribution that keeps the output exact.
    """
    residual = torch.clamp(p - q, min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / torch.where(mass > 0, mass, 1.0), p)


def one_hot_residual(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """residual_distribution(p, one_hot(x)) without building the one-hot: p with x removed, renormalised."""
    return residual_distribution(p, torch.zeros_like(p).scatter_(-1, x.unsqueeze(-1), 1.0)) if p.numel() else p


def _gather_tokens(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _uniforms(randomness, batch: int, k: int, device) -> torch.Tensor:
    if isinstance(randomness, torch.Tensor):
        return randomness
    return torch.rand(batch, k + 1, generator=randomness, device=device, dtype=torch.float64)


def _num_drafts(num_drafts, batch: int, k: int, device) -> torch.Tensor:
    if num_drafts is None:
        return torch.full((batch,), k, dtype=torch.long, device=device)
    return torch.as_tensor(num_drafts, dtype=torch.long, device=device)


def verify_leviathan(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, randomness,
                     num_drafts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al., Algorithm 1: one uniform per draft token, all positions at once."""
    batch, k = draft_tokens.shape
    u = _uniforms(randomness, batch, k, p.device)
    proposed = _num_drafts(num_drafts, batch, k, p.device)
    rows = torch.arange(batch, device=p.device)
    if k == 0:
        return proposed.new_zeros(batch), sample_with_uniforms(p[:, 0], u[:, -1])
    p_x = _gather_tokens(p[:, :k], draft_tokens)
    accept_prob = p_x if q is None else acceptance_probability(p_x, _gather_tokens(q, draft_tokens))
    in_range = torch.arange(k, device=p.device) < proposed.unsqueeze(1)
    accepted = (u[:, :k] < accept_prob) & in_range
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    # Row b continues from position n_b: the residual there, or p_{n_b+1} (the bonus) when all its drafts were
    # kept, which is the same formula with q = 0.
    p_n = p[rows, num_accepted]
    rejected = (num_accepted < proposed).unsqueeze(-1)
    at = num_accepted.clamp(max=k - 1)
    if q is None:
        dist = torch.where(rejected, one_hot_residual(p_n, draft_tokens[rows, at]), p_n)
    else:
        dist = residual_distribution(p_n, q[rows, at] * rejected)
    return num_accepted, sample_with_uniforms(dist, u[:, -1])


def verify_chen(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, randomness,
                num_drafts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chen et al., Algorithm 2: the sequential accept/reject loop, one row at a time, as in the paper."""
    batch, k = draft_tokens.shape
    u = _uniforms(randomness, batch, k, p.device)
    proposed = _num_drafts(num_drafts, batch, k, p.device).tolist()
    num_accepted = torch.zeros(batch, dtype=torch.long)
    next_token = torch.zeros(batch, dtype=torch.long)
    for b in range(batch):
        n = 0
        while n < proposed[b]:
            x = draft_tokens[b, n]
            q_x = 1.0 if q is None else q[b, n, x]
            if u[b, n] < acceptance_probability(p[b, n, x], q_x):
                n += 1
            else:
                residual = one_hot_residual(p[b, n], x) if q is None else residual_distribution(p[b, n], q[b, n])
                next_token[b] = sample_with_uniforms(residual, u[b, -1])
                break
        if n == proposed[b]:
            next_token[b] = sample_with_uniforms(p[b, n], u[b, -1])
        num_accepted[b] = n
    return num_accepted.to(p.device), next_token.to(p.device)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  num_drafts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy: keep drafts while they equal the target's argmax, then take the target's argmax."""
    return accept_greedy(draft_tokens, greedy(target_logits), num_drafts)


def accept_greedy(draft_tokens: torch.Tensor, target_tokens: torch.Tensor,
                  num_drafts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_greedy given the target's argmax [B, K+1] at each position instead of its logits."""
    batch, k = draft_tokens.shape
    if k == 0:  # plain decoding: nothing to check
        return torch.zeros(batch, dtype=torch.long, device=target_tokens.device), target_tokens[:, 0]
    proposed = _num_drafts(num_drafts, batch, k, target_tokens.device)
    matches = (draft_tokens == target_tokens[:, :k]) & (torch.arange(k, device=proposed.device) < proposed[:, None])
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)
    next_token = target_tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return num_accepted, next_token


def accept_greedy_lists(drafts: list[list[int]], target_tokens: list[list[int]],
                        num_drafts: list[int]) -> tuple[list[int], list[int]]:
    """accept_greedy on host lists (a step that has the target's argmax as lists already, no tensor op on its path):
    row b keeps its first drafts while they equal target_tokens[b], then takes the target's token after them."""
    accepted, next_tokens = [], []
    for row, target, n in zip(drafts, target_tokens, num_drafts):
        a = 0
        while a < n and row[a] == target[a]:
            a += 1
        accepted.append(a)
        next_tokens.append(target[a])
    return accepted, next_tokens


def verify(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, randomness,
           method: str = "leviathan", num_drafts=None) -> tuple[torch.Tensor, torch.Tensor]:
    if method == "leviathan":
        return verify_leviathan(draft_tokens, q, p, randomness, num_drafts)
    if method == "chen":
        return verify_chen(draft_tokens, q, p, randomness, num_drafts)
    raise ValueError(f"unknown rejection method {method!r}; choose one of {', '.join(METHODS)}")
