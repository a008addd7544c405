"""The bench's report (a JSON-ready dict, schema specdecode.bench/1) from its measurements.

One block per method and configuration (K, temperature): throughput over the runs, lengths, and what the method
adds (BenchMethod.report); speedups of every method over every other; the expected speedup next to the measured
one (BenchMethod.theory); per temperature, the recommended K: the best of the first method that recommends one.
On a workload with JSON schemas, each block also says how many outputs follow their schema; on the multi-turn
workload, "multi_turn" has the throughput per turn and the same-text check (bench/turns_report.py).
"""

from __future__ import annotations

import datetime

from . import stats as st
from .environment import environment
from .llamacpp_peers import LOOKUP_DEFAULT_TOKENS
from .methods import METHODS
from .methods.base import LLAMACPP
from .turns_report import turns_report
from .units import Measurement, Unit
from .validity import validator_name, validity

SCHEMA = "specdecode.bench/1"
LENGTHS = "ours: ignore_eos=True; transformers: min_new_tokens = max_new_tokens"
JSON_LENGTHS = ("every method stops at the end of its JSON value (its end-of-generation token counted) or after "
                "max_new_tokens; ours compiles schemas compact (no whitespace), llama.cpp's grammar allows one "
                "optional space between tokens")
TURN_LENGTHS = ("every method stops at its end-of-generation token (counted) or after max_new_tokens; lengths_match: "
                "each answer as long as the reference's (ours plain, greedy)")


def method_block(method, unit: Unit, runs: list[Measurement], max_new_tokens: int, batch_size: int,
                 schemas: list[dict] | None = None, reference_lengths: list[int] | None = None) -> dict:
    """Throughput (median over the runs, and its spread), the runs themselves, lengths, and the method's own
    fields; a method shared by every K says so. schemas: each row's JSON schema (the rows of a run, flattened):
    outputs stop at the end of their JSON value, and their validity is counted over every run.
    reference_lengths: each answer's length in the reference (the multi-turn workload), which lengths_match
    checks."""
    tps = [r.tokens_per_second for r in runs]
    mspt = [r.ms_per_token for r in runs]
    t, m = st.summarize(tps), st.summarize(mspt)
    block = {
        "tokens_per_second": t["median"], "tokens_per_second_mean": t["mean"], "tokens_per_second_std": t["std"],
        "tokens_per_second_min": t["min"], "tokens_per_second_max": t["max"],
        "ms_per_token": m["median"], "ms_per_token_mean": m["mean"], "ms_per_token_std": m["std"],
        "tokens_per_second_runs": tps, "ms_per_token_runs": mspt,
        "runs": [{"tokens": r.tokens, "seconds": r.seconds, "tokens_per_second": r.tokens_per_second,
                  "ms_per_token": r.ms_per_token, "per_prompt_tokens": r.per_prompt_tokens,
                  "per_prompt_seconds": r.per_prompt_seconds} for r in runs],
        "new_tokens_per_prompt": runs[0].per_prompt_tokens,
        "lengths_match": all(n == max_new_tokens for r in runs for n in r.per_prompt_tokens),
        "k": unit.k, "temperature": unit.temperature, "batch_size": batch_size,
    }
    if schemas is not None:
        block["lengths_match"] = all(n < max_new_tokens for r in runs for n in r.per_prompt_tokens)
        block["lengths_note"] = "JSON schemas: each output stops at the end of its JSON value; lengths_match: " \
                                "none was cut at max_new_tokens"
        block["json"] = validity([t for r in runs for t in r.texts], schemas * len(runs))
    if reference_lengths is not None:
        block["lengths_match"] = all(r.per_prompt_tokens == reference_lengths for r in runs)
    block.update(method.report(unit, runs))
    if not method.per_k:
        block["shared_across_k"] = True
    return block


def sweep_config(bench, temperature: float, k, measured: dict, costs: dict) -> dict:
    """Every method's block at one (K, temperature), its speedups over the others, and the theory."""
    s = bench.settings
    order = lambda u: (METHODS.index(u.method), u.draft_max or 0)  # noqa: E731  (the methods' order)
    blocks = {}
    for unit in sorted(bench.units(temperature), key=order):
        if unit.k in (None, k):
            blocks[unit.name] = method_block(bench.runners[unit.method], unit, measured[unit], s.max_new_tokens,
                                             s.batch_size, bench.row_schemas,
                                             bench.turns.reference_lengths if bench.turns else None)
    for name, block in blocks.items():
        block["speedup_vs"] = {other: (block["tokens_per_second"] / b["tokens_per_second"]
                                       if b["tokens_per_second"] else None)
                               for other, b in blocks.items() if other != name}
        # Ours against ours: the same rate after the prefill, because an answer under a schema and one without it
        # differ in length, and end to end a longer answer spreads the same prefill over more tokens.
        block["decode_speedup_vs"] = {other: block["decode_tokens_per_second"] / b["decode_tokens_per_second"]
                                      for other, b in blocks.items() if other != name
                                      and block.get("decode_tokens_per_second") and b.get("decode_tokens_per_second")}
    theory = next((t for m in bench.runners.values() if (t := m.theory(k, blocks, costs)) is not None), None)
    return {"k": k, "temperature": temperature, "methods": blocks, "theory": theory}


def recommendation(bench, configs: list[dict], temperature: float) -> dict:
    """The best K at a temperature for the first method that recommends one, and whether it beats plain."""
    name = next((m.name for m in bench.runners.values() if m.recommends and any(m.name in c["methods"]
                                                                               for c in configs)), None)
    if name is None:
        return {"temperature": temperature, "k": None, "method": None, "tokens_per_second": None,
                "speedup_vs_plain": None, "speculation_pays": None}
    best = max((c for c in configs if name in c["methods"]), key=lambda c: c["methods"][name]["tokens_per_second"])
    plain = best["methods"].get(bench.runners[name].plain)
    speedup = (best["methods"][name]["tokens_per_second"] / plain["tokens_per_second"]
               if plain and plain["tokens_per_second"] else None)
    return {"temperature": temperature, "k": best["k"], "method": name,
            "tokens_per_second": best["methods"][name]["tokens_per_second"], "speedup_vs_plain": speedup,
            "speculation_pays": speedup is None or speedup > 1.0}


def llama_config(bench) -> dict | None:
    """How llama.cpp's methods ran (None when none ran)."""
    ctx = bench.ctx
    if ctx.llama is None or not any(m.runs_on == LLAMACPP for m in bench.runners.values()):
        return None
    binary = ctx.llama_binary
    return {"target_gguf": ctx.llama.target_gguf, "draft_gguf": ctx.llama.draft_gguf,
            "draft_gguf_is": ctx.llama.draft_gguf_is, "threads": ctx.llama.threads,
            "n_ctx": ctx.llama_ctx, "flash_attn": True, "speculative_binary": binary.path if binary else None,
            "draft_max": list(bench.settings.llama_draft_max) if binary else None,
            "prompt_lookup_tokens": f"K; {LOOKUP_DEFAULT_TOKENS} (its default) for K=auto",
            "sampling_note": "min-p 0, typical-p 1, repeat penalty 1; llama.cpp applies top-p before the "
                             "temperature (ours after): the same distribution when top-p = 1 or T = 1"}


def bench_report(bench, measured: dict, costs: dict, elapsed: float) -> dict:
    """The whole report: the configuration, the costs, every (K, temperature) of the sweep and the
    recommendation; its top level repeats the configuration of the first recommendation."""
    s = bench.settings
    sweep = [sweep_config(bench, t, k, measured, costs) for t in s.temperatures for k in s.ks]
    by_temperature = [recommendation(bench, [c for c in sweep if c["temperature"] == t], t) for t in s.temperatures]
    first = by_temperature[0]
    top = next((c for c in sweep if c["temperature"] == first["temperature"] and
                (first["k"] is None or c["k"] == first["k"])), sweep[0])
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": elapsed,
        "environment": environment(bench.ctx.plain),
        "config": {**bench.info, "ks": list(s.ks), "temperatures": list(s.temperatures),
                   "max_new_tokens": s.max_new_tokens, "runs": s.runs, "warmup": s.warmup, "top_k": s.top_k,
                   "top_p": s.top_p, "methods": list(bench.methods), "seed": s.seed, "sampler": s.method,
                   "num_prompts": len(bench.prompt_ids), "batch_size": s.batch_size,
                   "rows_per_run": sum(len(b) for b in bench.batches),
                   "prompt_tokens": [len(p) for p in bench.prompt_ids],
                   "throughput": "end to end: new tokens / wall time of the generate() calls, prefill included",
                   "lengths": TURN_LENGTHS if bench.turns else LENGTHS if bench.ctx.schemas is None else JSON_LENGTHS,
                   "workload": workload(bench),
                   "json_validator": validator_name() if bench.ctx.schemas is not None else None,
                   "skipped": dict(bench.skipped),
                   "llamacpp": llama_config(bench)},
        "costs": costs,
        "sweep": sweep,
        "recommended": {"k": first["k"], "temperature": first["temperature"], "by_temperature": by_temperature},
        "k": top["k"], "temperature": top["temperature"],
        "methods": top["methods"],
        "theory": top["theory"],
        "multi_turn": turns_report(bench, measured) if bench.turns else None,
    }


def workload(bench) -> str:
    return "multi_turn" if bench.turns else "free text" if bench.ctx.schemas is None else "json_schema"
