"""What llama.cpp's methods share: they need the target as a GGUF file, and take the rows of a batch one after
another (llama.cpp's generation takes one prompt at a time). Their decoding is in bench/llamacpp_peers.py."""

from __future__ import annotations

import importlib.util

from ..units import Measurement, Unit
from .base import LLAMACPP, BenchContext, BenchMethod

NEEDS_GGUF = "llama.cpp's methods need a GGUF target (a built-in model or a .gguf file)"
ROWS = "one after another (llama.cpp's generation takes one prompt at a time)"


def run_llamacpp(peers, batches: list[list[list[int]]], max_new_tokens: int, temperature: float, top_k: int,
                 top_p: float, seed: int, lookup: int | None = None, stop_ids: set[int] | None = None) -> Measurement:
    """llama-cpp-python's own generation (LlamaCppPeers), every row one after another. stop_ids: rows stop at
    these tokens, and their token ids are kept (the multi-turn workload); None: exactly max_new_tokens each."""
    per_tokens, per_seconds, outputs = [], [], []
    for i, rows in enumerate(batches):
        seconds = 0.0
        for j, ids in enumerate(rows):
            new, t = peers.generate_ids(ids, max_new_tokens, temperature, top_k, top_p, seed + i * len(rows) + j,
                                        lookup, stop_ids)
            per_tokens.append(len(new))
            outputs.append(new)
            seconds += t
        per_seconds.append(seconds)
    return Measurement(sum(per_tokens), sum(per_seconds), per_tokens, per_seconds,
                       token_ids=outputs if stop_ids is not None else None)


def no_gguf_target(ctx: BenchContext) -> str | None:
    return NEEDS_GGUF if ctx.llama is None or ctx.llama.target_gguf is None else None


class LlamaCppPython(BenchMethod):
    """A method of llama-cpp-python's own generation loop on the target's GGUF file, same threads."""

    runs_on = LLAMACPP
    stops_at_eos = True

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        if no_gguf_target(ctx):
            return NEEDS_GGUF
        if importlib.util.find_spec("llama_cpp") is None:
            from ...backends.llamacpp import INSTALL_HINT

            return INSTALL_HINT
        return None

    def __init__(self, ctx: BenchContext):
        super().__init__(ctx)
        self.peers = ctx.llama_peers()  # loads nothing yet; a clear ImportError before anything is timed

    def lookup(self, unit: Unit) -> int | None:
        """The tokens LlamaPromptLookupDecoding drafts per step (None: plain decoding)."""
        return None

    def run(self, unit: Unit, batches, seed: int, schemas=None) -> Measurement:
        return run_llamacpp(self.peers, batches, seed=seed, lookup=self.lookup(unit), stop_ids=self.ctx.stop_ids,
                            **self.sampling(unit))

    def report(self, unit: Unit, runs: list[Measurement]) -> dict:
        return {"rows": ROWS}
