"""`specdecode eval multiplication`: does speculative sampling solve a task as well as plain sampling?

Few-shot prompts ask for a × b with a, b drawn uniformly from 1..99 (one random.Random per seed; several seeds are
pooled). The target answers each prompt twice, by plain sampling (our loop, no draft) and by speculative sampling
(target + draft), with the same sampling settings and the same max new tokens. Accuracy of each comes with a 95 %
Wilson interval, and a two-proportion z-test asks whether they differ. Lossless speculative sampling has exactly
the target's distribution, so the two accuracies differ only by sampling noise: a small p-value is a red flag.
A large p-value is no proof of equality; the interval width says how large a difference the test could see.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

from ..bench import stats as st
from ..bench.stats import merge_stats

FEW_SHOT = ((12, 34), (7, 86), (45, 23), (91, 8), (56, 67))
INSTRUCTION = "Compute each product exactly.\n"
_INT = re.compile(r"-?\d[\d,]*")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    seed: int

    @property
    def answer(self) -> int:
        return self.a * self.b


def make_prompt(a: int, b: int) -> str:
    shots = "".join(f"{x} * {y} = {x * y}\n" for x, y in FEW_SHOT)
    return f"{INSTRUCTION}{shots}{a} * {b} ="


def make_problems(nb_prompts: int, seeds: list[int], low: int = 1, high: int = 99) -> list[Problem]:
    """nb_prompts problems per seed, a and b uniform in [low, high]; the seeds' problems are pooled."""
    if nb_prompts < 1:
        raise ValueError(f"--nb-prompts must be >= 1, got {nb_prompts}")
    if not seeds:
        raise ValueError("at least one seed is needed")
    problems = []
    for seed in seeds:
        rng = random.Random(seed)
        problems += [Problem(rng.randint(low, high), rng.randint(low, high), seed) for _ in range(nb_prompts)]
    return problems


def parse_answer(text: str) -> int | None:
    """The first integer of the continuation ("1,035" reads 1035), or None when there is none."""
    match = _INT.search(text or "")
    if match is None:
        return None
    digits = match.group(0).rstrip(",").replace(",", "")
    try:
        return int(digits)
    except ValueError:
        return None


def _answer_all(generator, prompts: list[str], batch_size: int, seed: int, kwargs: dict,
                progress: Callable[[int], None] | None):
    texts, stats = [], []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        result = generator.generate(batch, seed=[(seed, start + j) for j in range(len(batch))], **kwargs)
        texts += result.texts
        stats.append(result.stats)
        if progress is not None:
            progress(len(batch))
    return texts, stats


def evaluate(plain, speculative, problems: list[Problem], max_new_tokens: int = 8, temperature: float = 0.7,
             top_k: int = 0, top_p: float = 1.0, batch_size: int = 16, seed: int = 0,
             progress: Callable[[str, int], None] | None = None) -> dict:
    """Answer every problem with both generators; accuracies, Wilson intervals, and the z-test."""
    prompts = [make_prompt(p.a, p.b) for p in problems]
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop=["\n"])
    runs = {}
    for name, gen, offset in (("plain", plain, 0), ("speculative", speculative, 500_009)):
        texts, stats = _answer_all(gen, prompts, batch_size, seed + offset, kwargs,
                                   (lambda n, name=name: progress(name, n)) if progress else None)
        parsed = [parse_answer(t) for t in texts]
        correct = [a == p.answer for a, p in zip(parsed, problems)]
        runs[name] = {"texts": texts, "parsed": parsed, "correct": correct, "stats": merge_stats(stats)}
    n = len(problems)
    result = {"schema": "specdecode.eval.multiplication/1", "n": n, "max_new_tokens": max_new_tokens,
              "sampling": {"temperature": temperature, "top_k": top_k, "top_p": top_p}, "methods": {}}
    for name, run in runs.items():
        x = sum(run["correct"])
        low, high = st.wilson_interval(x, n)
        stats = run["stats"]
        result["methods"][name] = {"correct": x, "n": n, "accuracy": x / n, "ci95": [low, high],
                                   "unparsed": sum(a is None for a in run["parsed"]),
                                   "tokens_per_second": stats.tokens_per_second,
                                   "acceptance_rate": stats.acceptance_rate if name == "speculative" else None,
                                   "mean_accepted_length": stats.mean_accepted_length
                                   if name == "speculative" else None}
    xp, xs = result["methods"]["plain"]["correct"], result["methods"]["speculative"]["correct"]
    z, p = st.two_proportion_ztest(xp, n, xs, n)
    result["comparison"] = {"difference": (xs - xp) / n, "z": z, "p_value": p,
                            "test": "two-sided two-proportion z-test, pooled variance",
                            "consistent": p >= 0.05}
    result["problems"] = [
        {"a": pr.a, "b": pr.b, "seed": pr.seed, "answer": pr.answer,
         "plain": {"text": runs["plain"]["texts"][i], "parsed": runs["plain"]["parsed"][i]},
         "speculative": {"text": runs["speculative"]["texts"][i], "parsed": runs["speculative"]["parsed"][i]}}
        for i, pr in enumerate(problems)]
    return result
