"""`specdecode verify`: an empirical losslessness check of speculative decoding on the user's own pair.

What it checks. For each prompt, the first P tokens that the speculative generator samples must follow the
target's own distribution: the first token from p(·|prompt), the second from p(·|prompt, x1), and so on, all
after the same sampling options (logit_bias and the penalties over each prefix, temperature, top-k, top-p,
min_p). This exact reference is computed by running the TARGET ALONE on every prefix that carries enough
probability (a tree of prefixes, expanded level by level), so the exact joint distribution of the first P tokens
and each position's exact marginal are known without any sampling. N sequences are then sampled with the
speculative generator (batches of copies of the prompt), and compared with the exact distributions:
total-variation distance and a chi-square goodness-of-fit test per position (marginals) and for the joint.

Cells. Every outcome falls into one cell of a partition whose exact probabilities are known: the kept tokens or
sequences, and one "rest" cell (prefixes too rare to expand, tokens too rare to list) whose probability is one
minus the others. Cells with an expected count below 5 are pooled for the chi-square test, as usual.

Decision. With m tests in total (prompts × (P + 1)), each test is run at level α/m (Bonferroni), so that an exact
sampler FAILs with probability at most α (default 0.001) overall. A test fails when its chi-square p-value is below
α/m, or when the TV distance exceeds a bound that an exact sampler exceeds with probability below α/m
(stats.tv_threshold), or when a sample falls in a cell the target gives (essentially) zero probability.

Limits, stated plainly. A PASS means no deviation was detected at this sample size: the report gives the TV
distance that the test could have detected. It covers only these prompts and the first P positions. The engine's
first token always comes from the target's prefill, and a step proposes at most (tokens left − 1) drafts, so with
P positions at most P − 2 drafts per step are exercised, whatever K is: use P ≥ K + 2 to exercise full steps.
With temperature 0 the check is that every sample equals the target's greedy continuation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ..exact.penalties import RowPenalties
from ..exact.sampling import SamplingParams, logits_to_probs
from ..bench import stats as st

REST = "rest"
DEFAULT_PROMPTS = ("def fibonacci(n):\n    ", "The quick brown fox")


@dataclass
class ExactDistribution:
    """The target's exact distribution of the first `positions` tokens after a prompt (see module docstring)."""

    positions: int
    joint: dict[tuple[int, ...], float]  # kept full sequences → probability
    marginals: list[dict[int, float]]  # position j (0-based) → {token: P(prefix expanded and x_j = token)}
    expanded: list[set[tuple[int, ...]]]  # expanded[j]: prefixes of length j whose conditional was computed
    forward_rows: int = 0  # target rows run to compute it

    @property
    def joint_rest(self) -> float:
        return max(0.0, 1.0 - sum(self.joint.values()))

    def marginal_rest(self, j: int) -> float:
        return max(0.0, 1.0 - sum(self.marginals[j].values()))

    def joint_cell(self, seq: Sequence[int]):
        key = tuple(seq[: self.positions])
        return key if key in self.joint else REST

    def marginal_cell(self, seq: Sequence[int], j: int):
        if tuple(seq[:j]) in self.expanded[j] and seq[j] in self.marginals[j]:
            return int(seq[j])
        return REST


def _keep(probs: np.ndarray, scale: float, limit: int = 256) -> np.ndarray:
    """Indices worth a cell of their own: all non-zero ones when few, else those of expected count >= 0.01."""
    nonzero = np.flatnonzero(probs > 0)
    if len(nonzero) <= limit:
        return nonzero
    return np.flatnonzero(probs * scale >= 0.01)


@torch.inference_mode()
def exact_distribution(backend, prompt_ids: list[int], params: SamplingParams, positions: int,
                       n_samples: int, min_expected: float = 5.0, max_nodes: int = 512, batch_size: int = 32,
                       progress: Callable[[str], None] | None = None) -> ExactDistribution:
    """Expand the prefix tree of the target's warped distribution, breadth first.

    backend: the target behind the ModelBackend interface (a generator's `.target`); only reset and forward are
    used, so any backend can be checked. A prefix is expanded (the target is run on it) when its expected count
    among n_samples is at least min_expected: rarer prefixes would land in pooled cells anyway. At most max_nodes
    prefixes are expanded.
    """
    if positions < 1:
        raise ValueError("positions must be >= 1")
    device, vocab_size = backend.device, backend.vocab_size
    joint: dict[tuple[int, ...], float] = {}
    marginals: list[dict[int, float]] = []
    expanded: list[set[tuple[int, ...]]] = []
    level: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    budget, rows = max_nodes, 0
    for j in range(positions):
        level.sort(key=lambda node: -node[1])
        chosen = [node for node in level if j == 0 or node[1] * n_samples >= min_expected][:budget]
        budget -= len(chosen)
        expanded.append({prefix for prefix, _ in chosen})
        marginal = np.zeros(vocab_size, dtype=np.float64)
        next_level = []
        for start in range(0, len(chosen), batch_size):
            batch = chosen[start:start + batch_size]
            ids = torch.tensor([list(prompt_ids) + list(prefix) for prefix, _ in batch], dtype=torch.long,
                               device=device)
            backend.reset(len(batch))
            logits = _adjusted(backend.forward(ids, last_only=True)[:, -1].float(), params, prompt_ids,
                               [prefix for prefix, _ in batch], vocab_size)
            rows += len(batch)
            if params.greedy:
                cond = torch.zeros_like(logits, dtype=torch.float64)
                cond[torch.arange(len(batch)), logits.argmax(dim=-1)] = 1.0
            else:
                cond = logits_to_probs(logits, params).double()
            cond = cond.cpu().numpy()
            for (prefix, prob), row in zip(batch, cond):
                marginal += prob * row
                if j == positions - 1:
                    for t in _keep(row, prob * n_samples):
                        joint[prefix + (int(t),)] = prob * float(row[t])
                else:
                    for t in np.flatnonzero(row * prob * n_samples >= min_expected):
                        next_level.append((prefix + (int(t),), prob * float(row[t])))
        marginals.append({int(t): float(marginal[t]) for t in _keep(marginal, n_samples, limit=4096)})
        if progress is not None:
            progress(f"exact distribution: position {j + 1}/{positions}, {len(chosen)} prefixes")
        level = next_level
    return ExactDistribution(positions, joint, marginals, expanded, rows)


def _adjusted(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], prefixes: list[tuple[int, ...]],
              vocab_size: int) -> torch.Tensor:
    """The logits after each prefix with the logit_bias and penalties of params (the prefix is the output so far)."""
    state = RowPenalties([params] * len(prefixes), [list(prompt_ids)] * len(prefixes), vocab_size, logits.device)
    state.advance([list(p) for p in prefixes])
    path = state.at_draft([])
    return logits if path is None else path.apply(logits)


def options(params: SamplingParams) -> dict:
    """The generate() keywords of params beyond temperature, top-k and top-p."""
    return dict(min_p=params.min_p, presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
                logit_bias=dict(params.logit_bias))


def sample_exact(exact: ExactDistribution, n: int, seed: int = 0) -> list[tuple[int, ...]]:
    """n sequences drawn from the kept cells of an exact joint (for tests; needs a negligible rest)."""
    if exact.joint_rest > 1e-6:
        raise ValueError(f"the exact joint leaves {exact.joint_rest:.2e} of its mass unlisted: cannot sample it")
    keys = list(exact.joint)
    probs = np.array([exact.joint[k] for k in keys], dtype=np.float64)
    rng = np.random.default_rng(seed)
    return [keys[i] for i in rng.choice(len(keys), size=n, p=probs / probs.sum())]


@dataclass
class SampleSet:
    sequences: list[tuple[int, ...]]
    provenance: dict[str, int] = field(default_factory=dict)  # token counts by provenance
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    max_drafts_per_step: int = 0  # the largest K a step used, as the engine counted it

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0


def sample_speculative(generator, prompt_ids: list[int], params: SamplingParams, positions: int, n: int,
                       batch_size: int = 100, seed: int = 0,
                       progress: Callable[[int], None] | None = None) -> SampleSet:
    """n sequences of `positions` tokens from the generator, in batches of identical prompts.

    Sample i is row i of one request seeded `seed` (a (seed, i) pair per row), whatever the batch it falls in.
    """
    out = SampleSet([])
    while len(out.sequences) < n:
        rows = min(batch_size, n - len(out.sequences))
        result = generator.generate([list(prompt_ids)] * rows, max_new_tokens=positions,
                                    temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    **options(params), seed=[(seed, len(out.sequences) + j) for j in range(rows)],
                                    ignore_eos=True)
        for tokens, kinds in zip(result.token_ids, result.provenance):
            if len(tokens) != positions:
                raise RuntimeError(f"the generator returned {len(tokens)} tokens instead of {positions}")
            out.sequences.append(tuple(tokens))
            for kind in kinds:
                out.provenance[kind] = out.provenance.get(kind, 0) + 1
        out.proposed_tokens += result.stats.proposed_tokens
        out.accepted_tokens += result.stats.accepted_tokens
        out.max_drafts_per_step = max(out.max_drafts_per_step, max(result.stats.k_histogram, default=0))
        if progress is not None:
            progress(rows)
    return out


def _test(name: str, cells: list, exact: dict, rest: float, n: int, level: float) -> dict:
    keys = list(exact) + [REST]
    probs = [exact[k] for k in exact] + [rest]
    counts = dict.fromkeys(keys, 0)
    for c in cells:
        counts[c] += 1
    observed = [counts[k] for k in keys]
    chi = st.chisquare_gof(observed, probs)
    tv = st.tv_distance([o / n for o in observed], probs)
    threshold = st.tv_threshold(probs, n, level)
    reasons = []
    if chi["impossible_samples"]:
        reasons.append(f"{chi['impossible_samples']} sample(s) fell where the target has (almost) no probability")
    elif chi["p_value"] < level:
        reasons.append(f"chi-square p = {chi['p_value']:.2e} < {level:.1e}")
    if tv > threshold:
        reasons.append(f"TV {tv:.4f} > {threshold:.4f}")
    top = sorted(((k, exact[k], counts[k] / n) for k in exact), key=lambda x: -x[1])[:5]
    return {"name": name, "samples": n, "cells": len(keys), "pooled_cells": chi["cells"], "tv": tv,
            "tv_threshold": threshold, "chi2": chi["statistic"], "dof": chi["dof"], "p_value": chi["p_value"],
            "level": level, "rest_probability": rest, "rest_frequency": counts[REST] / n,
            "top_cells": [{"cell": list(k) if isinstance(k, tuple) else k, "exact": p, "observed": f}
                          for k, p, f in top],
            "pass": not reasons, "reasons": reasons}


def check_samples(exact: ExactDistribution, sequences: Sequence[Sequence[int]], alpha: float = 1e-3,
                  num_tests: int | None = None) -> dict:
    """Compare sampled sequences with the exact distribution: one test per position and one for the joint.

    Each test runs at level alpha / num_tests (Bonferroni; num_tests defaults to positions + 1, the tests of this
    call). Returns {"pass", "tests": [...], "level", "detectable_tv"}.
    """
    n = len(sequences)
    if n == 0:
        raise ValueError("no samples")
    if any(len(s) < exact.positions for s in sequences):
        raise ValueError(f"every sample needs {exact.positions} tokens")
    num_tests = num_tests or exact.positions + 1
    level = alpha / num_tests
    tests = []
    for j in range(exact.positions):
        cells = [exact.marginal_cell(s, j) for s in sequences]
        tests.append(_test(f"position {j + 1}", cells, exact.marginals[j], exact.marginal_rest(j), n, level))
    cells = [exact.joint_cell(s) for s in sequences]
    tests.append(_test(f"joint 1..{exact.positions}", cells, exact.joint, exact.joint_rest, n, level))
    return {"pass": all(t["pass"] for t in tests), "level": level, "alpha": alpha, "num_tests": num_tests,
            "detectable_tv": tests[-1]["tv_threshold"], "tests": tests}


def verify_pair(generator, prompts: list[list[int]], params: SamplingParams, positions: int = 4,
                samples: int = 2000, batch_size: int = 100, seed: int = 0, alpha: float = 1e-3,
                max_nodes: int = 512, progress: Callable[[str, int], None] | None = None) -> dict:
    """The whole check on a generator (SpeculativeGenerator): exact distributions, samples, tests, verdict.

    The exact reference runs on the generator's own target backend (generator.target), so it is the model the
    samples come from, whatever its backend. progress(label, advance) is called as samples are drawn (advance =
    rows) and after each exact level (0).
    """
    num_tests = len(prompts) * (positions + 1)
    results = []
    for i, prompt in enumerate(prompts):
        exact = exact_distribution(generator.target, prompt, params, positions, samples, max_nodes=max_nodes,
                                   progress=(lambda label: progress(f"prompt {i + 1}: {label}", 0))
                                   if progress else None)
        drawn = sample_speculative(generator, prompt, params, positions, samples, batch_size, seed + 7919 * i,
                                   progress=(lambda rows: progress(f"prompt {i + 1}: sampling", rows))
                                   if progress else None)
        report = check_samples(exact, drawn.sequences, alpha, num_tests)
        report.update(prompt_index=i, prompt_tokens=len(prompt), exact_forward_rows=exact.forward_rows,
                      provenance=drawn.provenance, proposed_tokens=drawn.proposed_tokens,
                      accepted_tokens=drawn.accepted_tokens, acceptance_rate=drawn.acceptance_rate,
                      max_drafts_per_step=drawn.max_drafts_per_step)
        results.append(report)
    drafts_per_step = max(r["max_drafts_per_step"] for r in results)
    exercised = sum(r["proposed_tokens"] for r in results) > 0
    return {
        "schema": "specdecode.verify/1",
        "pass": all(r["pass"] for r in results),
        "alpha": alpha, "num_tests": num_tests, "level_per_test": alpha / num_tests,
        "samples_per_prompt": samples, "positions": positions,
        "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                     **options(params)},
        "k": generator.num_speculative_tokens, "max_drafts_per_step_exercised": drafts_per_step,
        "speculative_path_exercised": exercised,
        "prompts": results,
    }

