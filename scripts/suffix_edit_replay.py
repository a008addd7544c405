"""Replay the edit workload's turn 2 offline: what the suffix drafter offers at every position of the greedy answers
a `bench serve --workload edit` run recorded, how often its first token is kept per match length, and what a K rule,
the real `auto` policy, and an oracle would cost at a measured v(n) (no model runs; only the tokenizer).

    python scripts/suffix_edit_replay.py docs/results/serve-edit-suffix-tree1-default-pair.json

The history holds turn 1's prompt and answer (sent twice, as the workload does), the row's own context is turn 2's
chat prompt; each position's draft is compared with the recorded answer. The costs are the llama.cpp forward costs
measured on the default target (docs/BENCHMARKS.md, "Token trees"), or --v.

The policy is policy.AdaptivePolicy as a server drives it: one policy for the server's life (the batcher's session
keeps the generator's), asked before every step of the speculative sends, turn 1 then turn 2 of each prompt in the
workload's order, with what the session tells it (the cap the drafter offers, its draft class, drafts priced at
--draft-cost target steps each) and taught the drafts each step kept and a forward's time synthesized as v(K + 1)
target steps (no clock noise; --noise adds some). The plain sends teach it nothing (their K is fixed at 0). Turn 1's
positions are replayed the same way (the history then holds only the earlier prompts' turns).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import defaultdict

from transformers import AutoTokenizer

from specdecode.bench.prompts import load_builtin
from specdecode.bench.serve_edit import DEFAULT_FOLLOW_UP
from specdecode.backends.rows import RowChange, RowText
from specdecode.drafters.base import MATCH_CLASSES, DraftOutcome, DraftRows, match_class
from specdecode.drafters.suffix import SuffixDrafter, SuffixHistory
from specdecode.models.prepare import prepare_gguf
from specdecode.policy.choose import AdaptivePolicy, Outcome, Outlook

MEASURED_V = "1,1.61,2.18,2.70,3.35,4.02,4.56,6.30,7.0"  # v(n) for n = 1..9, in single-token steps
KMAX = 8
MAX_TOKENS = 256  # the workload's max_tokens: a row's cap is what it still wants, less one
STEP_S = 0.0372  # a one-token step of the default target (BENCHMARKS.md, "Token trees"); only ratios matter


def ids(encoded) -> list[int]:
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


def positions_of(drafter: SuffixDrafter, prompt: list[int], answer: list[int]) -> list[tuple[int, int, int]]:
    """Per answer position: (tokens offered, how many of them the answer has next, match length)."""
    text = RowText(0, list(prompt), [])
    drafter.relayout(RowChange((0,), (text,)))
    positions = []
    for i, token in enumerate(answer):
        draft = drafter.outlook(DraftRows([text], [KMAX], KMAX)).plan[1][0]  # the row's draft (suffix.py's plan)
        n = 0
        while n < len(draft.tokens) and i + n < len(answer) and draft.tokens[n] == answer[i + n]:
            n += 1
        positions.append((len(draft.tokens), n, draft.match))
        drafter.observe(DraftOutcome([text], [[token]], [0]))
        text.output.append(token)
    return positions


def replay(report: dict, tok) -> list[tuple[list, list]]:
    """Per prompt, (turn 1's positions, turn 2's positions): see positions_of."""
    prompts = [p.text for p in load_builtin("edit")]
    sent = {(r["prompt"], r["turn"], r["mode"]): r["text"] for r in report["per_request"]}
    out = []
    earlier = SuffixHistory()  # turn 1 drafts from what the server saw of the earlier prompts
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
        turn1 = positions_of(SuffixDrafter(earlier), prompt1, tok.encode(answer1))
        history = SuffixHistory()
        for _ in range(2):
            history.add(prompt1 + tok.encode(answer1))
        turn2 = positions_of(SuffixDrafter(history), prompt2, answer2)
        for mode in ("speculative", "plain"):
            earlier.add(prompt1 + tok.encode(sent[(p, 1, mode)]))
            earlier.add(prompt2 + tok.encode(sent[(p, 2, mode)]))
        out.append((turn1, turn2))
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


def best_class_rule(runs, v):
    """The best K per match class in hindsight (coordinate ascent on the summed cost): the most any rule that knows
    only the class can get from these answers, which no causal rule reaches."""
    ks = [0] * (len(MATCH_CLASSES) + 1)

    def rule(table):
        return lambda offered, match: min(offered, table[match_class(match)])

    def speed(table):
        return sum(map(len, runs)) / sum(len(p) / cost_ratio(p, v, rule(table)) for p in runs)

    for _ in range(3):
        for c in range(len(ks)):
            ks[c] = max(range(KMAX + 1), key=lambda k: (speed(ks[:c] + [k] + ks[c + 1:]), -k))
    return ks, rule(ks)


def policy_send(policy: AdaptivePolicy, positions, v, draft_cost: float, noise=None) -> tuple[float, dict]:
    """One speculative send under the policy, as the session asks it (DecodingSession._choose_k, _learn): plain
    decoding's cost over its cost, and its counts (steps, drafts offered and kept, K chosen). noise: a function
    returning the factor each forward's timing is read with (the cost counted stays v(K + 1))."""
    row = policy.new_row()
    i = cost = 0
    counts = {"steps": 0, "drafted": 0, "kept": 0, "k": defaultdict(int)}
    while i < len(positions):
        offered, right, match = positions[i]
        cap = min(offered, policy.max_k, MAX_TOKENS - i - 1)
        k = 0
        if cap > 0:
            outlook = Outlook([row], [cap], free=False, classes=[match_class(match)])
            k = min(policy.decide(outlook).k, cap)
        kept = min(k, right)
        timed = v[k] * STEP_S * (noise() if noise else 1.0)
        policy.learn(Outcome([row], k, [kept], [k], 1, draft_cost * k * STEP_S, timed))
        cost += draft_cost * k + v[k]
        counts["steps"] += 1
        counts["drafted"] += k
        counts["kept"] += kept
        counts["k"][k] += 1
        i += kept + 1
    return len(positions) / cost, counts


def policy_turns(runs, v, draft_cost: float, make=AdaptivePolicy, noise=None) -> tuple[list[float], dict]:
    """One policy for the server's life, over the speculative sends in the workload's order: turn 2's ratios and
    counts (turn 1 teaches it, as it does on a server)."""
    policy = make(KMAX)
    ratios, total = [], {"steps": 0, "drafted": 0, "kept": 0, "k": defaultdict(int)}
    for turn1, turn2 in runs:
        policy_send(policy, turn1, v, draft_cost, noise)
        ratio, counts = policy_send(policy, turn2, v, draft_cost, noise)
        ratios.append(ratio)
        for key in ("steps", "drafted", "kept"):
            total[key] += counts[key]
        for k, n in counts["k"].items():
            total["k"][k] += n
    return ratios, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="a bench serve --workload edit JSON report")
    parser.add_argument("--v", default=MEASURED_V, help="v(n) for n = 1..9, comma-separated")
    parser.add_argument("--draft-cost", type=float, default=0.0,
                        help="a suffix draft step's cost in target steps, for the policy (default 0: free)")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="the policy reads each forward's time times a log-normal factor of this sigma, and 5 %% "
                             "of them doubled (a busy machine's stalls); seeded. Default 0: exact")
    args = parser.parse_args()
    v = [float(x) for x in args.v.split(",")]
    _, tokenizer_dir = prepare_gguf("qwen2.5-coder-1.5b-instruct")
    both = replay(json.load(open(args.report)), AutoTokenizer.from_pretrained(tokenizer_dir))
    runs = [turn2 for _, turn2 in both]
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
    ks, rule = best_class_rule(runs, v)
    ratios = [cost_ratio(p, v, rule) for p in runs]
    print(f"{'K by class, hindsight':22s} median {statistics.median(ratios):.2f}x plain  " +
          " ".join(f"{r:.2f}" for r in ratios) + f"  (K per class: {ks})")
    rng = random.Random(0)
    noise = (lambda: rng.lognormvariate(0.0, args.noise) * (2.0 if rng.random() < 0.05 else 1.0)) \
        if args.noise else None
    ratios, counts = policy_turns(both, v, args.draft_cost, noise=noise)
    print(f"{'policy (auto)':22s} median {statistics.median(ratios):.2f}x plain  " +
          " ".join(f"{r:.2f}" for r in ratios))
    ratios = [oracle_ratio(p, v) for p in runs]
    print(f"{'oracle':22s} median {statistics.median(ratios):.2f}x plain  " + " ".join(f"{r:.2f}" for r in ratios))
    histogram = ", ".join(f"{k}: {n}" for k, n in sorted(counts["k"].items()))
    print(f"policy on turn 2: {counts['steps']} verifications, drafts kept / offered {counts['kept']} / "
          f"{counts['drafted']}; steps by K: {histogram}")


if __name__ == "__main__":
    main()
