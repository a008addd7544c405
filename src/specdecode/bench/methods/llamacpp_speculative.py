"""llama-speculative (one method per --llama-draft-max N, named llama-speculative-dmaxN): llama.cpp's
llama-speculative binary on the target and draft GGUF files, as a subprocess (see bench/llamacpp_peers.py).
Independent of our K: timed once per draft-max. It joins the default methods when --llama-speculative names it."""

from __future__ import annotations

import os
from pathlib import Path

from ..llamacpp_peers import SpeculativeBinary, write_prompt
from ..units import Measurement, Unit
from .base import NO_DRAFT, LLAMACPP, BenchContext, BenchMethod
from .llamacpp import ROWS, no_gguf_target


def run_llama_speculative(binary, setup, tokenizer, batches: list[list[list[int]]], max_new_tokens: int,
                          temperature: float, top_k: int, top_p: float, seed: int, draft_max: int,
                          n_ctx: int) -> Measurement:
    """llama.cpp's llama-speculative binary on each row, one after another; the prompt is our token ids written
    back as text (special tokens included), which it tokenizes itself."""
    per_tokens, per_seconds, runs = [], [], []
    for i, rows in enumerate(batches):
        seconds = 0.0
        for j, ids in enumerate(rows):
            prompt = write_prompt(tokenizer.decode(ids, skip_special_tokens=False))
            try:
                run, cmd = binary.run(Path(setup.target_gguf), Path(setup.draft_gguf), prompt, max_new_tokens,
                                      draft_max, setup.threads, n_ctx, temperature, top_k, top_p,
                                      seed + i * len(rows) + j)
            finally:
                os.unlink(prompt)
            per_tokens.append(run.new_tokens)
            seconds += run.seconds
            runs.append(run)
        per_seconds.append(seconds)
    drafted = [r.n_drafted for r in runs if r.n_drafted is not None]
    accepted = [r.n_accept for r in runs if r.n_accept is not None]
    extra = {"command": cmd, "prompt_tokens": [r.prompt_tokens for r in runs],
             "decode_tokens_per_second": [r.decode_tokens_per_second for r in runs],
             "n_drafted": sum(drafted) if drafted else None, "n_accept": sum(accepted) if accepted else None}
    return Measurement(sum(per_tokens), sum(per_seconds), per_tokens, per_seconds, extra=extra)


class LlamaSpeculative(BenchMethod):
    name = "llama-speculative"
    plain = "llamacpp-plain"
    default = False
    runs_on = LLAMACPP

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        if no_gguf_target(ctx):
            return no_gguf_target(ctx)
        if not ctx.has_draft:
            return NO_DRAFT
        if not ctx.llama.speculative_binary:
            return "give the binary: --llama-speculative PATH"
        if ctx.llama.draft_gguf is None:
            return "llama-speculative needs a GGUF draft (a built-in model or a .gguf file)"
        return None

    def __init__(self, ctx: BenchContext):
        super().__init__(ctx)
        self.binary = ctx.llama_binary = SpeculativeBinary.find(ctx.llama.speculative_binary)

    def units(self, temperature: float) -> list[Unit]:
        return [Unit(self.name, temperature, draft_max=n) for n in self.ctx.settings.llama_draft_max]

    def run(self, unit: Unit, batches, seed: int, schemas=None) -> Measurement:
        return run_llama_speculative(self.binary, self.ctx.llama, self.ctx.tokenizer, batches, seed=seed,
                                     draft_max=unit.draft_max, n_ctx=self.ctx.llama_ctx, **self.sampling(unit))

    def report(self, unit: Unit, runs: list[Measurement]) -> dict:
        from ..stats import summarize

        s = self.ctx.settings
        drafted = [r.extra["n_drafted"] for r in runs if r.extra.get("n_drafted") is not None]
        accepted = [r.extra["n_accept"] for r in runs if r.extra.get("n_accept") is not None]
        rates = [x for r in runs for x in r.extra["decode_tokens_per_second"]]
        return {
            "rows": ROWS, "draft_max": unit.draft_max, "command": runs[-1].extra["command"],
            # the binary stops after the step that passes -n, so it may make a few tokens more; all are counted
            "lengths_match": all(n >= s.max_new_tokens for r in runs for n in r.per_prompt_tokens),
            "lengths_note": "llama-speculative stops after the step that passes -n: it may make a few more tokens",
            "acceptance_rate": sum(accepted) / sum(drafted) if drafted and sum(drafted) else None,
            "n_drafted": sum(drafted) if drafted else None, "n_accept": sum(accepted) if accepted else None,
            "decode_tokens_per_second": summarize(rates)["median"] if rates else None,
            "prompt_tokens_llama": runs[-1].extra["prompt_tokens"],
            "throughput_note": "(prompt evaluation + decoding seconds it prints) per run; model loading left out",
        }
