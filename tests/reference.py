"""A chi-square goodness-of-fit check shared by the distribution tests."""

import torch
from scipy.stats import chisquare


def assert_matches(counts, probs, min_p=1e-3, pool_below=5.0):
    """Observed counts vs exact probabilities; cells expected below `pool_below` are pooled into one.

    Fails if a cell of probability 0 was observed, or if the chi-square p-value is below min_p. Returns p.
    """
    counts = torch.as_tensor(counts, dtype=torch.float64)
    probs = torch.as_tensor(probs, dtype=torch.float64)
    impossible = counts[probs == 0].sum()
    assert impossible == 0, f"{int(impossible)} samples fell on outcomes of target probability 0"
    expected = probs / probs.sum() * counts.sum()
    small = expected < pool_below
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) < 2:
        return 1.0
    result = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item())
    assert result.pvalue > min_p, (
        f"chi-square p={result.pvalue:.2e} over {len(exp)} cells: observed {obs.tolist()[:12]} vs expected "
        f"{[round(e, 1) for e in exp.tolist()[:12]]}")
    return result.pvalue


def hf_warp(logits, temperature: float, top_k: int, top_p: float):
    """The reference warping: transformers' own logits warpers, applied in their order."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    scores = logits.clone().float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k, min_tokens_to_keep=1)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p, min_tokens_to_keep=1)(None, scores)
    return scores


@torch.no_grad()
def target_conditionals(model, prompt: list[int], continuations: torch.Tensor, warp) -> torch.Tensor:
    """Exact warped next-token distributions of the target along each continuation: [N, n, V].

    A full forward without any cache, so nothing of the engine's cache handling is trusted.
    """
    n = continuations.shape[1]
    out = []
    for chunk in continuations.split(4096):
        ids = torch.cat([torch.tensor(prompt).expand(len(chunk), -1), chunk], dim=1)
        logits = model(ids).logits[:, len(prompt) - 1: len(prompt) - 1 + n]
        out.append(torch.softmax(warp(logits.reshape(-1, logits.shape[-1])), -1).reshape(len(chunk), n, -1))
    return torch.cat(out).double()


@torch.no_grad()
def exact_joint(model, prompt: list[int], length: int, warp) -> dict[tuple, float]:
    """P(first `length` new tokens = s) for every s, enumerated from the target model."""
    probs = {(): 1.0}
    for _ in range(length):
        prefixes = list(probs)
        ids = torch.tensor([prompt + list(s) for s in prefixes])
        cond = torch.softmax(warp(model(ids).logits[:, -1]), -1).double()
        probs = {s + (t,): probs[s] * c[t].item() for s, c in zip(prefixes, cond) for t in c.nonzero().flatten().tolist()}
    return probs


def pit_values(conditionals: torch.Tensor, tokens: torch.Tensor, generator) -> torch.Tensor:
    """Randomised probability integral transform: Uniform(0, 1) at each position iff tokens follow the conditionals.

    u = F(t - 1) + U * p(t), with F the conditional's CDF in token-id order. [N, n] in, [N, n] out.
    """
    cdf_before = conditionals.cumsum(-1) - conditionals
    p_t = conditionals.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert (p_t > 0).all(), "a token of target probability 0 was emitted"
    u = torch.rand(tokens.shape, generator=generator, dtype=torch.float64)
    return cdf_before.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) + u * p_t


def assert_uniform(values: torch.Tensor, bins: int = 20, min_p: float = 1e-3) -> float:
    counts = torch.histc(values.float().clamp(0, 1 - 1e-7), bins=bins, min=0, max=1)
    return assert_matches(counts, torch.full((bins,), 1.0 / bins), min_p=min_p)


def assert_first_tokens_follow_target(model, prompt: list[int], rows, temperature: float, length: int = 3,
                                      min_p: float = 1e-4) -> float:
    """The first `length` tokens of each generated row against the target's joint, enumerated (chi-square; a row
    outside the joint's support fails)."""
    import functools

    joint = exact_joint(model, prompt, length, functools.partial(hf_warp, temperature=temperature, top_k=0,
                                                                  top_p=1.0))
    index = {s: i for i, s in enumerate(joint)}
    observed = torch.zeros(len(joint) + 1)
    for row in rows:
        observed[index.get(tuple(row[:length]), len(joint))] += 1
    return assert_matches(observed, list(joint.values()) + [0.0], min_p=min_p)
