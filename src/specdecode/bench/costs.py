"""Step costs of a generator's models on a warm cache: the target's 1-token step, its (K+1)-token verification,
and the draft model's step; c and v(K) in target steps, the numbers Leviathan et al.'s speedup formula takes."""

from __future__ import annotations

import time

import torch

from . import stats as st
from .units import AUTO, int_ks


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return st.summarize(times)["median"]


def measure_costs(generator, prompt_ids: list[int], ks: list[int], repeats: int = 3) -> dict:
    """Forward costs on a warm cache (the prompt prefilled), on the generator's own backends.

    target_step_ms: a 1-token target forward; verify_ms[K]: a (K+1)-token target forward; draft_step_ms: a
    1-token forward of the draft model (none for a model-free drafter). c = draft step / target step; v[K] =
    verify / target step. Each is the median of `repeats` forwards after one untimed warm-up, with the cache
    trimmed back after every forward. Only the ModelBackend interface is used (reset, forward, trim, lengths).
    """
    repeats = max(1, repeats)
    draft = getattr(generator.drafter, "backend", None)  # a draft model's backend; None for prompt lookup

    def backend_timer(backend):
        device = backend.device
        backend.reset(1)
        backend.forward(torch.tensor([prompt_ids], dtype=torch.long, device=device), last_only=True)
        base = backend.lengths

        def step(n: int):
            ids = torch.tensor([[prompt_ids[i % len(prompt_ids)] for i in range(n)]], dtype=torch.long,
                               device=device)

            def run():
                backend.forward(ids)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                backend.trim(base)

            run()  # warm-up
            return _median_time(run, repeats)

        return step

    target_step = backend_timer(generator.target)
    t1 = target_step(1)
    verify = {k: target_step(k + 1) for k in sorted(set(ks))}
    result = {"repeats": repeats, "prompt_tokens": len(prompt_ids), "target_step_ms": 1000 * t1,
              "verify_ms": {str(k): 1000 * t for k, t in verify.items()},
              "v": {str(k): t / t1 for k, t in verify.items()}, "draft_step_ms": None, "c": None}
    if draft is not None:
        d1 = backend_timer(draft)(1)
        result.update(draft_step_ms=1000 * d1, c=d1 / t1)
    return result


def cost_ks(ks: list, auto_max: int) -> list[int]:
    """K values whose verification cost is measured: those asked for, 1..4, and 1..max under "auto"."""
    top = max(int_ks(ks) + [4] + ([auto_max] if AUTO in ks else []))
    return sorted(set(int_ks(ks)) | set(range(1, top + 1)))
