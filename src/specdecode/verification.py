"""One step's verification for a batch whose rows sample differently: greedy rows, rejection-sampled rows and
Gumbel-coupled rows each checked by their own exact rule, on the scores their tokens are drawn from; and the
log-probabilities of the tokens a step emits, read off the same scores."""

from __future__ import annotations

import torch

from .rejection import verify, verify_greedy
from .sampling import BatchSampling


def verify_rows(drafts: torch.Tensor, q: torch.Tensor | None, scores: torch.Tensor, sampling: BatchSampling,
                u: torch.Tensor, k_rows: list[int], method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted, next_token) per row. scores [B, K+1, V] are `sampling.scores(logits, masks)`: greedy rows take
    their argmax, sampled rows the rejection sampler on their softmax, coupled rows the argmax of scores plus their
    positions' noise (a greedy check on perturbed scores)."""
    if sampling.all_greedy:
        return verify_greedy(drafts, scores, k_rows)
    s = sampling.sampled_index
    k_rows = torch.tensor(k_rows, device=scores.device)
    sampled = scores[s] if sampling.any_greedy else scores
    if not sampling.any_coupled:
        accepted, tokens = verify(drafts[s], q, torch.softmax(sampled, dim=-1), u[s], method, k_rows[s])
        if not sampling.any_greedy:
            return accepted, tokens
        parts = [(s, accepted, tokens)]
    else:
        r, c = sampling.rejection_pos, sampling.coupled_pos
        parts = [(s[c], *verify_greedy(drafts[s[c]], sampled[c].double() + sampling.noise, k_rows[s[c]]))]
        if len(r):
            parts.append((s[r], *verify(drafts[s[r]], None if q is None else q[r], torch.softmax(sampled[r], dim=-1),
                                        u[s[r]], method, k_rows[s[r]])))
    if sampling.any_greedy:
        g = sampling.greedy_index
        parts.append((g, *verify_greedy(drafts[g], scores[g], k_rows[g])))
    num_accepted = torch.empty(len(sampling), dtype=torch.long, device=scores.device)
    next_token = torch.empty_like(num_accepted)
    for rows, accepted, tokens in parts:
        num_accepted[rows], next_token[rows] = accepted, tokens
    return num_accepted, next_token


def token_logprobs(scores: torch.Tensor, tokens: list[int], top: int) -> tuple[list[float], list[tuple]]:
    """One row's emitted tokens (positions 0..n-1 of scores [K+1, V]): each token's log-probability, and the `top`
    most likely (token, log-probability) pairs at its position, best first."""
    logp = torch.log_softmax(scores[: len(tokens)].float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    if top <= 0:
        return chosen, [() for _ in tokens]
    values, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
    return chosen, [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
