"""`specdecode bench latency`: ms/token of the target alone and with the draft, for one prompt: the forward costs,
then end-to-end decoding, plain and at each K, interleaved after a warm-up like the bench's methods."""

from __future__ import annotations

from typing import Callable

from ..engine.generators import AutoregressiveGenerator, SpeculativeGenerator
from . import stats as st
from .costs import cost_ks, measure_costs
from .environment import environment
from .interleave import interleave
from .methods.specdecode import SpecDecode
from .methods.specdecode_plain import SpecDecodePlain, run_ours
from .stats import merge_stats
from .units import Measurement, Unit

WARMUP_TOKENS = 8  # a warm-up decode: enough to run every kernel once


def measure_latency(target, draft, prompt_ids: list[int], ks: list, max_new_tokens: int = 32, runs: int = 3,
                    temperature: float = 0.0, seed: int = 0, repeats: int = 3, method: str = "leviathan",
                    progress: Callable[[str], None] | None = None) -> dict:
    """ms/token of the target alone and with the draft: forward costs, then end-to-end decoding of one prompt.

    target, draft: what the generators accept; ks: numbers of draft tokens per step, or "auto".
    """
    progress = progress or (lambda _label: None)
    plain = AutoregressiveGenerator(target)
    spec = {k: SpeculativeGenerator(target, draft, num_speculative_tokens=k, method=method) for k in ks} \
        if draft is not None else {}
    auto_max = max((g.max_speculative_tokens for g in spec.values()), default=1)
    costs = measure_costs(next(iter(spec.values()), plain), prompt_ids, cost_ks(ks, auto_max) if spec else [],
                          repeats)
    progress("step costs")
    units = [Unit(SpecDecodePlain.name, temperature)] + [Unit(SpecDecode.name, temperature, k) for k in spec]
    generators = dict(zip(units, [plain, *spec.values()]))

    def decode(unit: Unit, tokens: int, run_seed: int) -> Measurement:
        return run_ours(generators[unit], [[prompt_ids]], tokens, temperature, 0, 1.0, run_seed)

    measured = interleave(units, warm=lambda unit, _w: decode(unit, min(WARMUP_TOKENS, max_new_tokens), seed),
                          timed=lambda unit, r: decode(unit, max_new_tokens, seed + r), warmups=1, rounds=runs,
                          progress=progress, label=lambda unit: unit.label)
    plain_ms, plain_decode = _latency(measured[units[0]])
    result = {"schema": "specdecode.latency/1", "environment": environment(plain), "costs": costs,
              "max_new_tokens": max_new_tokens, "runs": runs, "temperature": temperature,
              "prompt_tokens": len(prompt_ids),
              "target_alone": {"step_ms": costs["target_step_ms"], "ms_per_token": plain_ms["median"],
                               "ms_per_token_std": plain_ms["std"], "decode_ms_per_token": plain_decode["median"]},
              "with_draft": []}
    for unit in units[1:]:
        ms, decode_ms = _latency(measured[unit])
        merged = merge_stats([x.stats for x in measured[unit]])
        result["with_draft"].append({
            "k": unit.k, "ms_per_token": ms["median"], "ms_per_token_std": ms["std"],
            "decode_ms_per_token": decode_ms["median"], "draft_step_ms": costs["draft_step_ms"],
            "verify_ms": costs["verify_ms"].get(str(unit.k)), "acceptance_rate": merged.acceptance_rate,
            "mean_accepted_length": merged.mean_accepted_length, "mean_k": getattr(merged, "mean_k", None),
            "speedup": plain_ms["median"] / ms["median"] if ms["median"] else None})
    return result


def _latency(measurements: list[Measurement]) -> tuple[dict, dict]:
    """Summaries of ms/token end to end, and after the prefill."""
    return (st.summarize([x.ms_per_token for x in measurements]),
            st.summarize([1000.0 / x.stats.decode_tokens_per_second for x in measurements
                          if x.stats.decode_tokens_per_second > 0]))
