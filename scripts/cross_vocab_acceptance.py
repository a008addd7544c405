"""Drafts of another tokenizer on the real models: per-position acceptance, mean accepted length and costs.

SmolLM2-135M-Instruct and Gemma 3 270M (other tokenizers: SLEM and TLI, drafters/cross_vocab.py) and the
same-tokenizer Qwen2.5-Coder-0.5B draft for the default target, Qwen2.5-Coder-1.5B-Instruct, all on llama.cpp. Each
configuration decodes the first --prompts chat prompts of the built-in code and prose sets (one batch) at a fixed K,
so every position is proposed every step: acceptance at position i = accepted_per_position[i] / proposed. The drafts'
costs: c = a draft forward of one token / a target forward of one token on a warm 64-token context (interleaved
rounds, medians: measure_costs below), and what drafting cost per proposed target token in the runs
(bridging and SLEM's extra forwards included), in target steps.

    python scripts/cross_vocab_acceptance.py --out docs/results/cross-vocab-drafts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdecode import SpeculativeGenerator, load_model
from specdecode.bench.environment import environment
from specdecode.bench.prompts import load_prompts
from specdecode.drafters import CrossVocabDrafter, ModelDrafter
from specdecode.text.chat import encode_chat

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFTS = {"qwen2.5-coder-0.5b-instruct": ["same"], "smollm2-135m-instruct": ["slem", "tli", "auto"],
          "gemma-3-270m": ["slem", "tli", "auto"]}


def drafter(draft, target, method: str):
    if method == "same":
        return ModelDrafter(draft.model)
    return CrossVocabDrafter(draft, target.tokenizer, method)


def run(target, draft_model, method: str, prompts: list[list[int]], k: int, temperature: float, new: int) -> dict:
    d = drafter(draft_model, target, method)
    gen = SpeculativeGenerator(target, d, num_speculative_tokens=k)
    start = time.perf_counter()
    result = gen.generate(prompts, max_new_tokens=new, temperature=temperature, seed=0)
    s = result.stats
    proposed, accepted = s.proposed_per_position, s.accepted_per_position
    return {
        "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
        "acceptance_per_position": [a / p if p else None for a, p in zip(accepted, proposed)],
        "accepted_per_position": accepted, "proposed_per_position": proposed,
        "new_tokens": sum(map(len, result.token_ids)), "verification_steps": s.verification_steps,
        "draft_time_s": s.draft_time_s, "verify_time_s": s.verify_time_s, "wall_s": time.perf_counter() - start,
        "draft_forward_calls": s.draft_forward_calls, "counts": dict(getattr(d, "counts", {}) or {}),
    }


def measure_costs(target, draft, rounds: int = 7) -> dict:
    """c (a draft forward of 1 token) and v(n) (a target forward of n tokens), in target steps, on warm 64-token
    contexts: every shape once per round, back to back, the medians of the rounds' own ratios (another process's
    load shifts a round's times together). Timed whatever the machine's load (pairing.pair.measure_pair_costs
    refuses a busy machine); the load is reported beside."""
    import os

    import torch

    backends = {"target": target.model, "draft": draft.model}
    context = list(range(1000, 1064 + 9))
    for backend in backends.values():
        backend.reset(1)
        backend.forward(torch.tensor([context[:64]]), last_only=True)

    def timed(name: str, n: int) -> float:
        backend = backends[name]
        start = time.perf_counter()
        backend.forward(torch.tensor([context[64:64 + n]]))
        elapsed = time.perf_counter() - start
        backend.trim([64])
        return elapsed

    shapes = [("target", 1), ("draft", 1), ("target", 2), ("target", 3), ("target", 4), ("target", 5)]
    for shape in shapes:
        timed(*shape)
    runs = [{shape: timed(*shape) for shape in shapes} for _ in range(rounds)]
    step = statistics.median(r[("target", 1)] for r in runs)
    ratio = {shape: statistics.median(r[shape] / r[("target", 1)] for r in runs) for shape in shapes}
    return {"c": ratio[("draft", 1)], "v": {str(n - 1): ratio[("target", n)] for n in (2, 3, 4, 5)},
            "target_step_ms": 1000 * step, "draft_step_ms": 1000 * statistics.median(r[("draft", 1)] for r in runs),
            "rounds": rounds, "load_average": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6, help="prompts of each set (code, prose)")
    parser.add_argument("--new", type=int, default=48, help="new tokens per prompt")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--drafts", default=",".join(DRAFTS))
    parser.add_argument("--methods", default="slem,tli", help="the methods to run, of those a draft has")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = args.prompts + 1
    target = load_model(TARGET, backend="llamacpp", max_rows=rows)
    sets = {name: [encode_chat(target.tokenizer, p.text) for p in load_prompts(name)[:args.prompts]]
            for name in ("code", "prose")}
    temperatures = [float(t) for t in args.temperatures.split(",")]
    report = {"schema": "specdecode.cross-vocab/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "environment": environment(), "target": TARGET, "k": args.k, "new_tokens": args.new,
              "prompts": args.prompts, "backend": "llamacpp", "drafts": {}}
    for name in args.drafts.split(","):
        draft = load_model(name, backend="llamacpp", max_rows=rows)
        costs = measure_costs(target, draft)
        entry = report["drafts"][name] = {"costs": costs, "runs": []}
        print(f"{name}: c = {costs['c']:.3f}, v(2) = {costs['v']['1']:.2f}, target step "
              f"{costs['target_step_ms']:.0f} ms", flush=True)
        for method in [m for m in DRAFTS[name] if m in args.methods.split(",")]:
            for domain, prompts in sets.items():
                for temperature in temperatures:
                    record = run(target, draft, method, prompts, args.k, temperature, args.new)
                    record.update(method=method, prompts=domain, temperature=temperature)
                    entry["runs"].append(record)
                    per_token = record["draft_time_s"] / max(1, sum(record["proposed_per_position"]))
                    record["draft_s_per_proposed_token"] = per_token
                    print(f"  {method:4} {domain:5} T={temperature}: acceptance {record['acceptance_rate']:.2f}, "
                          f"mean accepted {record['mean_accepted_length']:.2f}, per position "
                          f"{[round(a, 2) for a in record['acceptance_per_position'] if a is not None]}, drafting "
                          f"{1000 * per_token:.0f} ms per proposed token", flush=True)
        del draft
    step = statistics.median(d["costs"]["target_step_ms"] for d in report["drafts"].values())
    report["target_step_ms_median"] = step
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
