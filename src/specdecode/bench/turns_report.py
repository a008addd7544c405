"""The multi-turn workload's part of the bench report (bench/sessions.py): per turn number, and per kind of session
and turn, each timed unit's throughput, its ratios to llama.cpp's peers and to ours plain, ours' acceptance, and
whether it gave the reference's answers.

A group's throughput in a run is its prompts' new tokens over their generate() seconds (prefill included, as the
rest of the bench); the block gives the median over the runs, and ratios are of medians, within one interleaved
run. Greedy decoding is exact, so every answer is compared with the reference's, token by token: a mismatch is
listed (the method, session, turn, runs, first differing token), never hidden. llama.cpp's methods decode the
target's GGUF file in llama-cpp-python's own batches, and ours may run on another backend: a near-tie of the
logits may then flip a token, and the turns after it still decode the same prompts (built from the reference).
"""

from __future__ import annotations

import statistics

from .methods import METHODS
from .serve_edit import first_difference
from .stats import merge_stats
from .units import Measurement, Unit

PEERS = ("llamacpp-plain", "llamacpp-prompt-lookup", "specdecode-plain")  # the ratios of every row
HISTORY = ("the suffix drafters' history is emptied before every run (warm-up or timed): within a run it holds the "
           "earlier turns and sessions of that run, never an answer from an earlier run")
REFERENCE = ("every turn's prompt is built from ours plain's greedy answers (until the end of generation or "
             "max_new_tokens), decoded once before the timed runs; every method decodes the same prompts")


def label(unit: Unit) -> str:
    return unit.name + (f" K={unit.k}" if unit.k is not None else "")


def turns_report(bench, measured: dict[Unit, list[Measurement]]) -> dict:
    plan = bench.turns
    # the methods' order (ours first, then llama.cpp's), each method's Ks in the sweep's order
    units = sorted((u for u in bench.units(bench.settings.temperatures[0]) if u in measured),
                   key=lambda u: METHODS.index(u.method))
    prompts = range(len(plan.rows))
    turns = sorted({plan.turn_of(i) for i in prompts})
    kinds = list(dict.fromkeys(s.kind for s in plan.sessions))
    by_turn = [group(units, measured, plan, [i for i in prompts if plan.turn_of(i) == t], turn=t) for t in turns]
    by_kind_turn = [group(units, measured, plan, indices, turn=t, kind=kind) for kind in kinds for t in turns
                    if (indices := [i for i in prompts if plan.turn_of(i) == t and plan.kind_of(i) == kind])]
    mismatches = [m for u in units for m in unit_mismatches(plan, u, measured[u])]
    return {"sessions": [{"id": s.id, "kind": s.kind, "turns": len(s.turns)} for s in plan.sessions],
            "prompts": [{"session": plan.session_of(i), "kind": plan.kind_of(i), "turn": plan.turn_of(i),
                         "prompt_tokens": len(plan.prompt_ids[i]), "reference_tokens": len(plan.reference_ids[i])}
                        for i in prompts],
            "reference": REFERENCE, "history": HISTORY, "peers": list(PEERS),
            "by_turn": by_turn, "by_kind_turn": by_kind_turn, "mismatches": mismatches}


def group(units: list[Unit], measured: dict, plan, indices: list[int], turn: int, kind: str | None = None) -> dict:
    """One turn (of one kind of session, or all): every unit's block, with its ratios to the peers."""
    blocks = {label(u): unit_block(u, measured[u], plan, indices) for u in units}
    for u in units:
        peers = {name: peer_unit(units, name, u.k) for name in PEERS}
        rate = blocks[label(u)]["tokens_per_second"]
        blocks[label(u)]["speedup_vs"] = {name: rate / blocks[label(p)]["tokens_per_second"]
                                          for name, p in peers.items()
                                          if p is not None and p != u and blocks[label(p)]["tokens_per_second"]}
    return {"turn": turn, "kind": kind, "prompts": len(indices), "methods": blocks}


def peer_unit(units: list[Unit], name: str, k) -> Unit | None:
    """The peer a unit is compared with: the one of the same K when the peer has one per K, else its first."""
    candidates = [u for u in units if u.method == name]
    return next((u for u in candidates if u.k == k), candidates[0] if candidates else None)


def unit_block(unit: Unit, runs: list[Measurement], plan, indices: list[int]) -> dict:
    rates = [group_rate(r, indices) for r in runs]
    block = {"method": unit.name, "k": unit.k, "tokens_per_second": statistics.median(rates),
             "tokens_per_second_runs": rates, "new_tokens": sum(runs[0].per_prompt_tokens[i] for i in indices),
             "same_text": same_text(plan, runs, indices)}
    if runs[0].call_stats is not None:
        merged = merge_stats(r.call_stats[i] for r in runs for i in indices)
        if merged.proposed_tokens:
            block.update(acceptance_rate=merged.acceptance_rate, mean_accepted_length=merged.mean_accepted_length)
    return block


def group_rate(run: Measurement, indices: list[int]) -> float:
    """The group's tokens over its seconds in one run (one prompt per generate() call: --batch-size 1)."""
    seconds = sum(run.per_prompt_seconds[i] for i in indices)
    return sum(run.per_prompt_tokens[i] for i in indices) / seconds if seconds > 0 else 0.0


def same_text(plan, runs: list[Measurement], indices: list[int]) -> dict | None:
    """How many of the group's answers, over the runs, are the reference's token for token (None: not kept)."""
    if runs[0].token_ids is None:
        return None
    equal = sum(r.token_ids[i] == plan.reference_ids[i] for r in runs for i in indices)
    return {"identical": equal, "answers": len(runs) * len(indices)}


def unit_mismatches(plan, unit: Unit, runs: list[Measurement]) -> list[dict]:
    """Each prompt whose answer differs from the reference's in some run: where it first differs."""
    if runs[0].token_ids is None:
        return []
    found = []
    for i, reference in enumerate(plan.reference_ids):
        differ = [r for r, run in enumerate(runs) if run.token_ids[i] != reference]
        if differ:
            answer = runs[differ[0]].token_ids[i]
            found.append({"method": label(unit), "session": plan.session_of(i), "kind": plan.kind_of(i),
                          "turn": plan.turn_of(i), "runs": differ,
                          "first_difference": first_difference(answer, reference), "tokens": len(answer),
                          "reference_tokens": len(reference)})
    return found
