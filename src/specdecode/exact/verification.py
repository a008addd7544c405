"""One step's verification for a batch whose rows sample differently: greedy rows, rejection-sampled rows and
Gumbel-coupled rows each checked by their own exact rule, on the scores their tokens are drawn from (chains, or
token trees: verify_tree_rows); and the log-probabilities of the tokens a step emits, read off the same scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rejection import verify, verify_greedy
from .sampling import BatchSampling
from .token_tree import depths, verify_tree_greedy, verify_tree_sampled


@dataclass
class Verified:
    """What one verification decided, per row: the proposal's tokens, how many were kept, the token after them."""

    drafts: list[list[int]]
    accepted: list[int]
    next_tokens: list[int]
    scores: torch.Tensor | None  # [B, K+1, V]: what each position's token was drawn from (for logprobs); None:
    # a greedy step that asked the target for its argmaxes only (no row wanted logprobs)
    paths: list[list[int]] | None = None  # a tree step's kept nodes per row (drafts then lists their tokens)
    leaves: list[bool] | None = None  # a tree step: whether the row's path ended at a leaf (its last token a bonus)
    hidden: torch.Tensor | None = None  # [B, K+1, H] the target's last hidden states (a drafter that reads them)
    kept_lengths: list[int] | None = None  # [B] a chain step: the tokens row b's target cache keeps (trim to these)

    def emitted(self, b: int) -> list[int]:
        return self.drafts[b][: self.accepted[b]] + [self.next_tokens[b]]

    @classmethod
    def of_tree(cls, tokens: list[list[int]], parents: list[list[int]], widths: list[int], paths: list[list[int]],
                next_tokens: list[int], scores: torch.Tensor, logprobs: bool) -> "Verified":
        """A tree step's outcome as a chain's: the kept nodes' tokens, and (for logprobs) the scores along them.

        Worked example, one row of 3 nodes, tokens [a, b, c], parents [-1, 0, -1] (a then b from the root, c a
        sibling of a). scores[:, 0] is the distribution after the root, scores[:, i + 1] after node i. The path [0, 1]
        keeps a, b (drafts [a, b], scores at [0, 1, 2]); the path [2] keeps c (drafts [c], scores at [0, 3]): node 2
        has no child, so the row's path ended at a leaf and the token after it is a bonus, while a path [0] (a
        kept, b rejected) ends at a node with a child: the token after it is a correction."""
        if logprobs:
            at = [[0] + [i + 1 for i in path] for path in paths]
            width = max(map(len, at))
            index = torch.tensor([a + [0] * (width - len(a)) for a in at], device=scores.device)
            scores = scores.gather(1, index.unsqueeze(-1).expand(-1, -1, scores.shape[-1]))
        drafts = [[row[i] for i in path] for row, path in zip(tokens, paths)]
        leaves = [(path[-1] if path else -1) not in par[:n] for par, n, path in zip(parents, widths, paths)]
        return cls(drafts, [len(p) for p in paths], next_tokens, scores, paths, leaves)

    def drafts_behind_last(self, b: int, width: int) -> int:
        """The drafts row b was given, as its last token's provenance counts them: a tree row whose path ended at a
        leaf had no more to give (its last token is a bonus), whatever the tree's width."""
        return self.accepted[b] if self.leaves and self.leaves[b] else width


def verify_rows(drafts: torch.Tensor, q: torch.Tensor | None, scores: torch.Tensor, sampling: BatchSampling,
                u: torch.Tensor, k_rows: list[int], method: str,
                noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted, next_token) per row. scores [B, K+1, V] are `sampling.scores(logits, masks)`: greedy rows take
    their argmax, sampled rows the rejection sampler on their softmax, coupled rows the argmax of scores plus their
    positions' noise [C, K+1, V] (a greedy check on perturbed scores)."""
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
        parts = [(s[c], *verify_greedy(drafts[s[c]], sampled[c].double() + noise, k_rows[s[c]]))]
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


def verify_tree_rows(tokens: list[list[int]], parents: list[list[int]], scores: torch.Tensor,
                     sampling: BatchSampling, u: torch.Tensor, widths: list[int],
                     noise: torch.Tensor | None = None) -> tuple[list[list[int]], list[int]]:
    """(path, next_token) per row of a tree step (token_tree.py): row b's first widths[b] nodes, scores [B, N+1, V]
    at its tree positions (0: after the root). Greedy rows walk the argmax, coupled rows the argmax of scores plus
    the noise of each position's depth, sampled rows the multi-candidate rule with u[b, :n] and u[b, -1]."""
    paths, next_tokens = [], []
    coupled_rank = {int(b): i for i, b in enumerate(sampling.sampled_index[sampling.coupled_pos])} \
        if sampling.any_coupled else {}
    for b, n in enumerate(widths):
        toks, par = tokens[b][:n], parents[b][:n]
        row = scores[b, : n + 1]
        if sampling.greedy_rows[b]:
            path, nxt = verify_tree_greedy(toks, par, row)
        elif b in coupled_rank:
            at = noise[coupled_rank[b]][[0] + depths(par)]
            path, nxt = verify_tree_greedy(toks, par, row.double() + at)
        else:
            path, nxt = verify_tree_sampled(toks, par, torch.softmax(row, dim=-1), torch.cat([u[b, :n], u[b, -1:]]))
        paths.append(path)
        next_tokens.append(nxt)
    return paths, next_tokens
