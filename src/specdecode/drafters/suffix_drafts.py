"""Drafting from a TokenLog (suffix_index.py), as SuffixDecoding does: `speculate` finds the best chain below the
matches of a context's suffix (the most frequent path, scored by the estimated acceptance of each token), and
`speculate_tree` grows a token tree from the same continuations, best node first."""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from .suffix_index import MAX_MATCH, SEP, WALK, TokenLog


@dataclass
class Draft:
    """A chain of drafted tokens; score = the sum of each draft's estimated acceptance (the expected number
    kept); match = the length of the context suffix it was found at; ends: the match positions that support it;
    docs: the ids of the history documents they lie in (a history's drafts)."""

    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    match: int = 0
    ends: list[int] = field(default_factory=list)
    docs: set = field(default_factory=set)
    rows: list[list[int]] = field(default_factory=list)  # the continuations of the chosen match (a tree's source)
    limit: int = 0  # the longest draft that match allows
    tree: tuple | None = None  # (tokens, parents, score) of its token tree, when the drafter grows trees


def draft_limit(match: int, max_tokens: int, factor: float, offset: float) -> int:
    """The longest draft a match of `match` tokens allows: match * factor + offset (SuffixDecoding's rule), and all
    max_tokens where the match is as deep as the index reaches (MAX_MATCH): such a match may be far longer than it
    could be seen (a file copied whole), and a long copy's draft pays at its full length (the policy chooses how much
    of it to verify from the acceptance of its match class)."""
    if match >= MAX_MATCH:
        return max_tokens
    return min(max_tokens, int(match * factor + offset + 1e-6))


def speculate(log: TokenLog, tail: list[int], max_tokens: int, min_prob: float, factor: float = 1.0,
              offset: float = 0.0, before: int | None = None, beat: float | None = None) -> Draft:
    """The best draft of at most max_tokens from log for a context ending in tail (SuffixDecoding's path
    speculation): for each match length m found, the most frequent path below it, cut at draft_limit(m) tokens
    (m * factor + offset; all max_tokens for a match of MAX_MATCH tokens) and where the estimated acceptance falls
    below min_prob; the highest score wins (ties: the longer match). beat: only a draft scoring above it is wanted;
    where none can, the empty draft comes back (sooner)."""
    if max_tokens <= 0 or not tail:
        return Draft()
    tail, need = tail if isinstance(tail, list) else list(tail), 1
    if beat is not None and factor >= 0:  # (limits grow with the match length m)
        # A draft of limit tokens scores at most limit (each token's estimate is <= 1, exactly so in floats too):
        # only matches of `need` tokens or more can beat `beat`.
        while draft_limit(need, max_tokens, factor, offset) <= beat:
            if need == len(tail):
                return Draft()
            need += 1
    else:
        beat = None
    ends, lengths = log.match_lists(tail, WALK, log.start_of(before), need)
    if not ends:
        return Draft()
    best, best_score, shortest = None, 0.0, min(lengths)
    for m in sorted(set(lengths), reverse=True) if shortest < max(lengths) else (shortest,):
        limit = draft_limit(m, max_tokens, factor, offset)
        if limit <= best_score or (beat is not None and limit <= beat):  # shorter matches draft no more tokens
            break
        chosen = ends if m == shortest else [e for e, length in zip(ends, lengths) if length >= m]
        tokens, score, firsts = log.frequent_path(chosen, limit, min_prob)
        if score > best_score:
            best, best_score = (tokens, score, m, firsts, limit, chosen), score
    if best is None or (beat is not None and best_score <= beat):
        return Draft()
    tokens, score, m, firsts, limit, chosen = best
    # the continuations of the chosen match (a tree's source), read for the winner only
    return Draft(tokens, score, m, firsts, rows=log.following(chosen, max_tokens), limit=limit)


def speculate_tree(draft: Draft, budget: int, min_prob: float, width: int,
                   max_leaves: int | None = None) -> tuple[list[int], list[int], float]:
    """(tokens, parents, score) of a token tree of at most `budget` nodes from a draft's continuations: best first by
    estimated acceptance (the product of count / support along the path, as for a chain), at most `width` children
    per node, none below min_prob and none deeper than the draft's limit. Taking nodes in that order gives a tree
    (a child's estimate is at most its parent's) whose first n nodes are the best tree of n nodes, and with
    width 1 it is the chain itself. score: the sum of the nodes' estimates (the expected number kept). max_leaves: a
    node that would make one leaf more than that is passed over (on llama.cpp each leaf takes a sequence)."""
    tokens: list[int] = []
    parents: list[int] = []
    heap: list = []
    order, score = 0, 0.0

    def expand(node: int, rows: list[list[int]], depth: int, prob: float) -> None:
        nonlocal order
        if depth >= draft.limit:
            return
        counts = Counter(r[depth] for r in rows)
        counts.pop(SEP, None)
        for token, count in counts.most_common(width):  # ties: the most recent occurrence first
            child = prob * count / len(rows)
            if child >= min_prob:
                heapq.heappush(heap, (-child, order, node, token, depth))
                order += 1
        expansions[node] = rows

    expansions: dict[int, list[list[int]]] = {}
    expand(-1, draft.rows, 0, 1.0)
    leaves, parents_taken = 0, set()
    while heap and len(tokens) < budget:
        neg, _, parent, token, depth = heapq.heappop(heap)
        grows = parent < 0 or parent in parents_taken  # a child of a leaf replaces it; any other is a new leaf
        if grows and max_leaves is not None and leaves >= max_leaves:
            continue
        leaves += grows
        parents_taken.add(parent)
        rows = [r for r in expansions[parent] if r[depth] == token]
        tokens.append(token)
        parents.append(parent)
        score -= neg
        expand(len(tokens) - 1, rows, depth + 1, -neg)
    return tokens, parents, score
