"""Replay the edit workload's turn 2 offline: what the suffix drafter offers at every position of the greedy answers
a `bench serve --workload edit` run recorded, how often its first token is kept per match length, and what a K rule
would cost at a measured v(n) (no model runs; only the tokenizer).

    python scripts/suffix_edit_replay.py docs/results/serve-edit-suffix-tree1-default-pair.json

The history holds turn 1's prompt and answer (sent twice, as the workload does), the row's own context is turn 2's
chat prompt; each position's draft is compared with the recorded answer. The costs are the llama.cpp forward costs
measured on the default target (docs/BENCHMARKS.md, "Token trees"), or --v.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch
from transformers import AutoTokenizer

from specdecode.bench.prompts import load_builtin
from specdecode.bench.serve_edit import DEFAULT_FOLLOW_UP
from specdecode.drafters.base import MATCH_CLASSES, match_class
from specdecode.drafters.suffix import SuffixDrafter, SuffixHistory
from specdecode.models.prepare import prepare_gguf

MEASURED_V = "1,1.61,2.18,2.70,3.35,4.02,4.56,6.30,7.0"  # v(n) for n = 1..9, in single-token steps
KMAX = 8


def ids(encoded) -> list[int]:
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


def replay(report: dict, tok) -> list[list[tuple[int, int, int]]]:
    """Per prompt, per answer position: (tokens offered, how many of them the answer has next, match length)."""
    prompts = [p.text for p in load_builtin("edit")]
    sent = {(r["prompt"], r["turn"], r["mode"]): r["text"] for r in report["per_request"]}
    out = []
    for p, text in enumerate(prompts):
        if (p, 2, "plain") not in sent:
            continue
        first = [{"role": "user", "content": text}]
        answer1 = sent[(p, 1, "speculative")]
        prompt1 = ids(tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True))
        prompt2 = ids(tok.apply_chat_template(first + [{"role": "assistant", "content": answer1},
                                                       {"role": "user", "content": DEFAULT_FOLLOW_UP}],
                                              add_generation_prompt=True, tokenize=True))
        answer2 = tok.encode(sent[(p, 2, "plain")])
        history = SuffixHistory()
        for _ in range(2):
            history.add(prompt1 + tok.encode(answer1))
        drafter = SuffixDrafter(history)
        drafter.prefill(torch.tensor([prompt2]), None)
        positions = []
        for i, token in enumerate(answer2):
            draft = drafter._draft(0, KMAX)
            n = 0
            while n < len(draft.tokens) and i + n < len(answer2) and draft.tokens[n] == answer2[i + n]:
                n += 1
            positions.append((len(draft.tokens), n, draft.match))
            drafter.update([[token]], [0])
        out.append(positions)
    return out


def cost_ratio(positions, v, rule) -> float:
    """Plain decoding's cost over the rule's: rule(offered, match) -> drafts this step."""
    i = cost = 0
    while i < len(positions):
        offered, right, match = positions[i]
        k = rule(offered, match)
        cost += v[k]
        i += min(k, right) + 1
    return len(positions) / cost


def oracle_ratio(positions, v) -> float:
    """The best any rule could do: each step's K chosen knowing how many drafts it would keep (dynamic programming)."""
    best = [0.0] * (len(positions) + 1)
    for i in range(len(positions) - 1, -1, -1):
        offered, right, _ = positions[i]
        best[i] = min(v[k] + best[min(len(positions), i + min(k, right) + 1)] for k in range(min(offered, KMAX) + 1))
    return len(positions) / best[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="a bench serve --workload edit JSON report")
    parser.add_argument("--v", default=MEASURED_V, help="v(n) for n = 1..9, comma-separated")
    args = parser.parse_args()
    v = [float(x) for x in args.v.split(",")]
    _, tokenizer_dir = prepare_gguf("qwen2.5-coder-1.5b-instruct")
    runs = replay(json.load(open(args.report)), AutoTokenizer.from_pretrained(tokenizer_dir))
    kept = defaultdict(lambda: [0, 0])
    for positions in runs:
        for offered, right, match in positions:
            if offered:
                kept[match_class(match)][0] += right > 0
                kept[match_class(match)][1] += 1
    bounds = [str(b) for b in MATCH_CLASSES] + [f">{MATCH_CLASSES[-1]}"]
    print("first draft kept, by match length (class upper bound: kept / offered):")
    print("  " + ", ".join(f"{bounds[c]}: {a / n:.2f} ({n})" for c, (a, n) in sorted(kept.items())))
    rules = {f"every draft, K <= {k}": (lambda k: lambda off, m: min(off, k))(k) for k in (3, 8)}
    rules.update({f"match >= {m}, K <= 3": (lambda m: lambda off, match: min(off, 3) if match >= m else 0)(m)
                  for m in (2, 4, 6)})
    for name, rule in rules.items():
        ratios = [cost_ratio(p, v, rule) for p in runs]
        print(f"{name:22s} median {statistics.median(ratios):.2f}x plain  " + " ".join(f"{r:.2f}" for r in ratios))
    ratios = [oracle_ratio(p, v) for p in runs]
    print(f"{'oracle':22s} median {statistics.median(ratios):.2f}x plain  " + " ".join(f"{r:.2f}" for r in ratios))


if __name__ == "__main__":
    main()
