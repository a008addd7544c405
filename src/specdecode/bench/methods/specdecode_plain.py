"""specdecode-plain: our decoding loop without a draft (AutoregressiveGenerator), the baseline of ours; on the json
workload, under each prompt's JSON schema (its forced tokens still ride as certain drafts)."""

from __future__ import annotations

import time

from ..units import Measurement, Unit
from .base import BenchMethod


def run_ours(generator, batches: list[list[list[int]]], max_new_tokens: int, temperature: float, top_k: int,
             top_p: float, seed: int, json_schemas: list[list[dict]] | None = None,
             until_eos: bool | None = None) -> Measurement:
    """Our generator on each batch (its rows decoded together). Free text: every row makes exactly max_new_tokens
    tokens (ignore_eos=True). json_schemas (each batch's rows' schemas): each row follows its schema and stops at
    the end of its JSON value (its end-of-generation token counted, as llama.cpp's is), its text kept.
    until_eos (default: with schemas): rows stop at their end-of-generation token and their texts are kept, also
    without schemas (the json workload's prompts decoded as free text)."""
    from ..stats import merge_stats

    until_eos = json_schemas is not None if until_eos is None else until_eos
    per_tokens, per_seconds, all_stats, texts, ids = [], [], [], [], []
    for i, rows in enumerate(batches):
        schemas = json_schemas[i] if json_schemas is not None else None
        t0 = time.perf_counter()
        result = generator.generate([list(r) for r in rows], max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_k=top_k, top_p=top_p, seed=seed + i, ignore_eos=not until_eos,
                                    json_schema=schemas)
        per_seconds.append(time.perf_counter() - t0)
        per_tokens += [len(t) for t in result.token_ids]
        all_stats.append(result.stats)
        texts += result.texts or []
        ids += result.token_ids
    return Measurement(sum(per_tokens), sum(per_seconds), per_tokens, per_seconds, stats=merge_stats(all_stats),
                       texts=texts if until_eos else None, token_ids=ids if until_eos else None,
                       call_stats=all_stats)


def ours_report(runs: list[Measurement], structured: bool = False) -> dict:
    """The engine's counters merged over the runs, and its throughput after the prefill; under JSON schemas, where
    the tokens came from: forced by the grammar (verified as certain drafts, no model drafted them), drafted (the
    drafter's, accepted) and sampled by the target itself."""
    from ..stats import merge_stats, summarize

    merged = merge_stats([r.stats for r in runs])
    block = {"stats": merged.to_dict(),
             "decode_tokens_per_second": summarize([r.stats.decode_tokens_per_second for r in runs])["median"]}
    if structured:
        sampled = merged.new_tokens - merged.forced_tokens - merged.accepted_tokens
        block["token_sources"] = {"forced": merged.forced_tokens, "drafted": merged.accepted_tokens,
                                  "sampled": sampled, "proposed": merged.proposed_tokens,
                                  "forced_fraction": merged.forced_tokens / merged.new_tokens
                                  if merged.new_tokens else 0.0}
    return block


class SpecDecodePlain(BenchMethod):
    name = "specdecode-plain"
    structured = True
    stops_at_eos = True

    def run(self, unit: Unit, batches, seed: int, schemas=None) -> Measurement:
        return run_ours(self.ctx.plain, batches, seed=seed, json_schemas=schemas, until_eos=self.ctx.until_eos,
                        **self.sampling(unit))

    def report(self, unit: Unit, runs: list[Measurement]) -> dict:
        return ours_report(runs, structured=self.ctx.schemas is not None)
