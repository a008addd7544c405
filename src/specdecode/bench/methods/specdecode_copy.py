"""specdecode-prompt-lookup and specdecode-suffix: ours with a drafter that copies instead of running a model,
made by the bench whatever --draft is, so that one interleaved run compares the drafts: --draft (a model, or
suffix+MODEL) as specdecode, prompt lookup and the suffix drafter as these two, on the same target, prompts and K
sweep. The suffix drafter's history holds --suffix-history-tokens and is emptied before every run, as
specdecode's (fresh_history). Their drafts cost no forward, so Leviathan's formula, which prices a draft model's
step, gives them no theory. Default methods of the multi-turn workload; elsewhere run when --methods names them.
"""

from __future__ import annotations

from .base import BenchContext
from .specdecode import SpecDecode


class _SpecDecodeCopy(SpecDecode):
    """Ours with a model-free drafter of its own: one SpeculativeGenerator per K of the sweep, sharing it."""

    recommends = False
    default = False
    on_request = True

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        return None  # no draft model needed

    def __init__(self, ctx: BenchContext):
        from ...engine.generators import SpeculativeGenerator

        super().__init__(ctx)
        drafter = self.drafter()
        self.generators = {k: SpeculativeGenerator(ctx.target, drafter, num_speculative_tokens=k,
                                                   method=ctx.settings.method) for k in ctx.settings.ks}

    def drafter(self):
        raise NotImplementedError

    def theory(self, k, blocks: dict, costs: dict) -> dict | None:
        return None


class SpecDecodePromptLookup(_SpecDecodeCopy):
    name = "specdecode-prompt-lookup"

    def drafter(self):
        from ...drafters import PromptLookupDrafter

        return PromptLookupDrafter()


class SpecDecodeSuffix(_SpecDecodeCopy):
    name = "specdecode-suffix"

    def drafter(self):
        from ...drafters import SuffixDrafter

        return SuffixDrafter(history_tokens=self.ctx.settings.suffix_history_tokens)
