"""hf-assisted: transformers' assisted generation with the SAME draft object and the same K, constant schedule and
the confidence-threshold early stop disabled, so it drafts exactly K tokens per step; for K = "auto",
transformers' own dynamic setting (its defaults: up to 20 drafts, stopped early when the draft's confidence falls
under an adaptive threshold). With prompt lookup as our draft, transformers' prompt lookup with the same K (the
engine's largest under "auto"). It takes one row at a time."""

from __future__ import annotations

from ..units import AUTO, Measurement, Unit
from .base import NO_DRAFT, TRANSFORMERS, BenchContext, BenchMethod
from .hf import run_hf
from .hf_plain import NEEDS_TRANSFORMERS


class HFAssisted(BenchMethod):
    name = "hf-assisted"
    runs_on = TRANSFORMERS
    per_k = True
    plain = "hf-plain"
    recommends = True

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        if ctx.hf_target is None:
            return NEEDS_TRANSFORMERS
        if not ctx.has_draft:
            return NO_DRAFT
        if ctx.hf_draft is None and not ctx.lookup:
            return "transformers' assisted generation needs a transformers draft"
        if ctx.settings.batch_size > 1:
            return "transformers' assisted generation takes one row at a time (--batch-size 1)"
        return None

    def run(self, unit: Unit, batches, seed: int, schemas=None) -> Measurement:
        args = dict(seed=seed, **self.sampling(unit))
        if self.ctx.lookup:  # transformers has prompt lookup too, with a fixed number of tokens
            k = self.ctx.auto_max if unit.k == AUTO else unit.k
            return run_hf(self.ctx.hf_target, self.ctx.tokenizer, batches, prompt_lookup=k, **args)
        return run_hf(self.ctx.hf_target, self.ctx.tokenizer, batches, assistant=self.ctx.hf_draft, k=unit.k,
                      **args)

    def report(self, unit: Unit, runs: list[Measurement]) -> dict:
        tokens = sum(r.tokens for r in runs)
        target_calls = sum(r.target_calls for r in runs)
        draft_calls = sum(r.draft_calls for r in runs)
        return {"acceptance_rate": (tokens - target_calls) / draft_calls if draft_calls else 0.0,
                "mean_accepted_length": tokens / target_calls if target_calls else 0.0,
                "target_forward_calls": target_calls, "draft_forward_calls": draft_calls,
                "counting_note": "from forward-call counts: accepted = tokens - target calls, proposed = draft "
                                 "calls; tokens per target call includes the first (prefill + verify) call"}
