"""hf-plain: transformers' generate() (greedy or sampling, DynamicCache) on the target, batches left-padded."""

from __future__ import annotations

from ..units import Measurement, Unit
from .base import TRANSFORMERS, BenchContext, BenchMethod
from .hf import run_hf

NEEDS_TRANSFORMERS = "transformers' generate() needs a transformers target"


class HFPlain(BenchMethod):
    name = "hf-plain"
    runs_on = TRANSFORMERS

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        return NEEDS_TRANSFORMERS if ctx.hf_target is None else None

    def run(self, unit: Unit, batches, seed: int, schemas=None) -> Measurement:
        return run_hf(self.ctx.hf_target, self.ctx.tokenizer, batches, seed=seed, **self.sampling(unit))
