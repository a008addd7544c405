"""specdecode: our speculative decoding (SpeculativeGenerator) with the draft and K (a number, or "auto": the
engine's adaptive K); on the json workload, under each prompt's JSON schema. The fixed-K configurations get
Leviathan et al.'s expected speedup, with the measured costs, next to the measured one.

A suffix draft (--draft suffix, suffix+MODEL) keeps a history of earlier prompts and answers and copies from it.
Every run (warm-up or timed) starts with an empty history (fresh_history): within a run it holds what a server
would have seen before each request (the earlier prompts of the run), never an answer from an earlier run of the
same prompts, nor another K's or method's.
"""

from __future__ import annotations

from ..units import AUTO, Measurement, Unit
from .base import NO_DRAFT, BenchMethod, BenchContext
from .specdecode_plain import ours_report, run_ours


class SpecDecode(BenchMethod):
    name = "specdecode"
    per_k = True
    plain = "specdecode-plain"
    recommends = True
    structured = True
    stops_at_eos = True

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        return None if ctx.has_draft else NO_DRAFT

    def __init__(self, ctx: BenchContext):
        super().__init__(ctx)
        self.generators = ctx.spec  # one per K

    def generator(self, unit: Unit):
        """The unit's generator, its suffix history (if any) emptied: a run starts from nothing seen."""
        generator = self.generators[unit.k]
        fresh_history(generator.drafter)
        return generator

    def run(self, unit: Unit, batches, seed: int, schemas=None) -> Measurement:
        return run_ours(self.generator(unit), batches, seed=seed, json_schemas=schemas,
                        until_eos=self.ctx.until_eos, **self.sampling(unit))

    def report(self, unit: Unit, runs: list[Measurement]) -> dict:
        from ..stats import merge_stats

        merged = merge_stats([r.stats for r in runs])
        pos = merged.per_position_acceptance
        block = {**ours_report(runs, structured=self.ctx.schemas is not None),
                 "acceptance_rate": merged.acceptance_rate,
                 "mean_accepted_length": merged.mean_accepted_length, "per_position_acceptance": pos,
                 "alpha": pos[0] if pos else 0.0, "target_forward_calls": merged.target_forward_calls,
                 "draft_forward_calls": merged.draft_forward_calls}
        if unit.k == AUTO:  # the K the engine chose, step by step
            block.update(mean_k=merged.mean_k, k_histogram=dict(merged.k_histogram), plain_steps=merged.plain_steps)
        return block

    def theory(self, k, blocks: dict, costs: dict) -> dict | None:
        """The formulas hold for a fixed K, with the measured draft cost c and verification cost v."""
        from .. import stats as st

        spec = blocks.get(self.name)
        if spec is None or k == AUTO or costs.get("c") is None:
            return None
        alpha, c, v = spec["alpha"], costs["c"], costs["v"][str(k)]
        plain = blocks.get(self.plain)
        theory = {
            "alpha": alpha, "alpha_note": "acceptance of the first draft of each step (Leviathan's α = E[β])",
            "c": c, "v": v,
            "expected_tokens_per_step": st.expected_tokens_per_step(alpha, k),
            "measured_tokens_per_step": spec["mean_accepted_length"],
            "expected_speedup": st.expected_speedup(alpha, k, c),
            "expected_speedup_refined": st.expected_speedup(alpha, k, c, v),
            "measured_speedup": (spec["tokens_per_second"] / plain["tokens_per_second"]
                                 if plain and plain["tokens_per_second"] else None),
        }
        spec["expected_speedup"] = theory["expected_speedup"]
        spec["expected_speedup_refined"] = theory["expected_speedup_refined"]
        return theory


def fresh_history(drafter) -> None:
    """Empty the history of a suffix drafter (suffix+MODEL's suffix part; any other drafter has none), keeping its
    size. Rows left from the last call leave first, into the old history, so none reaches the new one."""
    from ...drafters import RowChange, SuffixDrafter, SuffixHistory

    suffix = getattr(drafter, "suffix", drafter)
    if isinstance(suffix, SuffixDrafter):
        suffix.relayout(RowChange(()))
        suffix.history = SuffixHistory(suffix.history.max_tokens)
