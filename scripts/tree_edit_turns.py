"""Token trees against chains on iterative editing: target forwards and wall time of turn 2, drafted by the suffix
drafter from the history of turn 1, with tree width 1 (chains) and W (trees), and v(n) of a tree forward against a
chain forward of the same width.

This runs the target through transformers (a GGUF dequantized to fp32; prepacked Linear weights), where a forward
of up to 8 tokens costs about one step; scripts/tree_verify_costs.py measures llama.cpp's forwards. Greedy, fixed K, the same drafter settings
otherwise; every turn 2 is checked token for token against plain decoding.

    python scripts/tree_edit_turns.py --target qwen2.5-coder-0.5b-instruct --nb-prompts 4 --json FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode import AutoregressiveGenerator, SpeculativeGenerator, SuffixDrafter, load_model
from specdecode.bench.prompts import load_prompts
from specdecode.bench.serve_edit import DEFAULT_FOLLOW_UP
from specdecode.exact.token_tree import chain


def chat(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def forward_costs(backend, widths, context=512, repeats=5):
    """Median seconds of a forward of n + 1 tokens as a chain and as a tree (half the nodes hung below the root)."""
    out = {}
    ids = torch.randint(100, 20000, (1, context))
    for n in widths:
        times = {"chain": [], "tree": []}
        for _ in range(repeats):
            for kind in times:
                backend.reset(1)
                backend.forward(ids, last_only=True)
                step = torch.randint(100, 20000, (1, n + 1))
                t = time.perf_counter()
                if kind == "chain":
                    backend.forward(step)
                else:
                    backend.forward_tree(step, [chain(n - n // 2) + [-1] * (n // 2)])
                times[kind].append(time.perf_counter() - t)
        out[n + 1] = {k: statistics.median(v) for k, v in times.items()}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--nb-prompts", type=int, default=4)
    ap.add_argument("--width", type=int, default=3)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.target, backend="transformers", prepack=True)
    tok = loaded.tokenizer
    plain = AutoregressiveGenerator(loaded)
    rows = []
    for i, prompt in enumerate(load_prompts("edit")[: args.nb_prompts]):
        messages = [{"role": "user", "content": prompt.text}]
        turn1 = plain.generate(chat(tok, messages), max_new_tokens=args.n, temperature=0.0)
        messages += [{"role": "assistant", "content": turn1.texts[0]}, {"role": "user", "content": DEFAULT_FOLLOW_UP}]
        second = chat(tok, messages)
        runs = {}
        for mode in ("plain", 1, args.width, "plain "):  # plain twice: before and after, for the wall-time ratio
            if mode in ("plain", "plain "):
                t = time.perf_counter()
                r = plain.generate(second, max_new_tokens=args.n, temperature=0.0)
                runs.setdefault("plain_s", []).append(time.perf_counter() - t)
                runs["plain"] = r
                continue
            drafter = SuffixDrafter(tree_width=mode)
            drafter.history.add(turn1.prompt_token_ids[0] + turn1.token_ids[0])  # turn 1, as a server keeps it
            gen = SpeculativeGenerator(loaded, drafter, num_speculative_tokens=args.k)
            t = time.perf_counter()
            runs[mode] = gen.generate(second, max_new_tokens=args.n, temperature=0.0)
            runs[f"{mode}_s"] = time.perf_counter() - t
        base = runs["plain"]
        row = {"prompt": i, "tokens": len(base.token_ids[0]), "plain_s": statistics.median(runs["plain_s"])}
        for w in (1, args.width):
            r = runs[w]
            row[f"w{w}"] = {"same_text": r.token_ids == base.token_ids, "forwards": r.stats.target_forward_calls - 1,
                            "tokens_per_forward": len(r.token_ids[0]) / max(1, r.stats.target_forward_calls - 1),
                            "speedup": row["plain_s"] / runs[f"{w}_s"]}
        rows.append(row)
        print(json.dumps(row))
    costs = forward_costs(plain.target, [1, 3, 5, 7])
    print("forward seconds (chain, tree) by tokens:", json.dumps(costs))
    report = {"target": args.target, "k": args.k, "width": args.width, "max_new_tokens": args.n, "turns": rows,
              "forward_s": costs, "cpu_threads": args.threads}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
