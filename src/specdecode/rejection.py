"""The modified rejection sampler of speculative decoding: pure tensor math, no models.

Given K draft tokens x_1..x_K drawn from the draft's distributions q_1..q_K, and the target's
distributions p_1..p_{K+1} at the same positions (plus one more), keep x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw from normalize(max(0, p_i - q_i)); if all K are
kept, draw a bonus token from p_{K+1}. Every emitted token is then distributed exactly as the target's
(Leviathan et al. 2023, Theorem 1; Chen et al. 2023, Theorem 1).

Shapes: draft_tokens [B, K] (int64), q [B, K, V], p [B, K+1, V]. Each verifier returns
(num_accepted [B] int64 in 0..K, next_token [B] int64). The generator is the call's own: never reseeded.
"""

from __future__ import annotations

import torch

from .sampling import sample

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


def _gather_tokens(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def verify_leviathan(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                     generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al., Algorithm 1: one uniform per draft token, all positions at once."""
    batch, k = draft_tokens.shape
    if k == 0:
        return draft_tokens.new_zeros(batch), sample(p[:, 0], generator)
    accept_prob = acceptance_probability(_gather_tokens(p[:, :k], draft_tokens), _gather_tokens(q, draft_tokens))
    u = torch.rand(batch, k, generator=generator, device=p.device, dtype=accept_prob.dtype)
    accepted = u < accept_prob
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    # Row b continues from position n_b: the residual there, or p_{K+1} (the bonus) when n_b == K, which is the
    # same formula with q_{K+1} = 0.
    rows = torch.arange(batch, device=p.device)
    p_n = p[rows, num_accepted]
    q_n = q[rows, num_accepted.clamp(max=k - 1)] * (num_accepted < k).unsqueeze(-1)
    next_token = sample(residual_distribution(p_n, q_n), generator)
    return num_accepted, next_token


def verify_chen(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chen et al., Algorithm 2: the sequential accept/reject loop, one row at a time, as in the paper."""
    batch, k = draft_tokens.shape
    num_accepted = torch.zeros(batch, dtype=torch.long)
    next_token = torch.zeros(batch, dtype=torch.long)
    for b in range(batch):
        n = 0
        while n < k:
            x = draft_tokens[b, n]
            r = torch.rand((), generator=generator, device=p.device)
            if r < acceptance_probability(p[b, n, x], q[b, n, x]):
                n += 1
            else:
                next_token[b] = sample(residual_distribution(p[b, n], q[b, n]), generator)
                break
        if n == k:
            next_token[b] = sample(p[b, k], generator)
        num_accepted[b] = n
    return num_accepted.to(p.device), next_token.to(p.device)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy: keep drafts while they equal the target's argmax, then take the target's argmax."""
    batch, k = draft_tokens.shape
    target_tokens = torch.argmax(target_logits, dim=-1)  # [B, K+1]
    matches = (draft_tokens == target_tokens[:, :k]).long()
    num_accepted = matches.cumprod(dim=1).sum(dim=1)
    next_token = target_tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return num_accepted, next_token


def verify(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None,
           method: str = "leviathan") -> tuple[torch.Tensor, torch.Tensor]:
    if method == "leviathan":
        return verify_leviathan(draft_tokens, q, p, generator)
    if method == "chen":
        return verify_chen(draft_tokens, q, p, generator)
    raise ValueError(f"unknown rejection method {method!r}; choose one of {', '.join(METHODS)}")
