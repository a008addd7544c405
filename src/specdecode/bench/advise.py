"""`specdecode advise`: what speculative decoding can give on this machine, measured in one short run.

What is measured, on the caller's target (and draft) as loaded, one prompt at a time (bench.costs.measure_costs:
forwards on a warm cache, medians):
- the target's step (a forward of 1 token) and v(n) = a forward of n tokens / a forward of 1, n = 1..max_k + 1
  (verifying K drafts is a forward of K + 1 tokens);
- the draft model's costs in target steps: c, its forward of 1 token; c2, of 2 tokens; and its prompt's forward
  (0 for drafters without a model: prompt lookup, suffix; for suffix+MODEL, which runs MODEL only on the steps
  where some row does not copy, c and c2 times the share of such steps in its run at max_k);
- for each drafter, one run at a fixed K = max_k on the prompts: how often draft j was proposed and kept.

One run at the largest K predicts every smaller K: a step's drafts at K are the first K of its drafts at max_k,
so draft j is kept at K when it is at max_k (exactly for greedy drafts; in expectation when sampling). Per step,
with L the drafts the drafter proposed (a draft model: always K; prompt lookup: what its n-gram match offers),
  S_j = P(L >= j and drafts 1..j kept) = accepted_per_position[j-1] / steps
  P_j = P(L >= j)                      = proposed_per_position[j-1] / steps
and the acceptance of position j is a_j = S_j / S_{j-1}: given drafts 1..j-1 were kept, the chance draft j is
kept (Leviathan et al.'s conditional acceptance; for prompt lookup it includes the chance draft j was offered).
  E(K)       = 1 + sum_{j<=K} prod_{i<=j} a_i                                tokens per step
  time(K)    = c sum_{j<=K} P_j + (c2 - c) S_K + sum_l P(min(K, L) = l) v(l+1)  target steps per step
  speedup(K) = E(K) / time(K)                                                over plain decoding
For a draft model (P_j = 1) this is Leviathan's K c + v(K + 1) with one correction the loop showed: after a step
that kept all its drafts, the next step's first draft forward feeds two tokens (the last draft and the bonus
token), S_K of the time. A draft model also reads its prompt in a row's first step (lazily, so that rows decoded
plainly never pay for it): over a row of n new tokens the speedup is n / (n time(K) / E(K) + prefill), which is
what advise predicts, ranks and checks for the given prompts and length (`speedup_at_length`; `speedup` is the
long-generation limit). The roofline is what a perfect free draft would give here (a_i = 1, no draft cost):
max_K (K + 1) / v(K + 1).

The best K of each drafter (with measure="all": every K) is then decoded on the same prompts beside plain
decoding, and its measured speedup of decode tokens/s (after the target's prefill, the draft's included as in the
prediction) reported next to the prediction; also end to end, the target's prefill counted, as `specdecode bench`
reports tokens/s.
"""

from __future__ import annotations

import datetime
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from ..pairing.draft_choice import (CROSS_TOKENIZER_ACCEPTANCE, TYPICAL_ACCEPTANCE, DraftCosts, choose_draft,
                                    machine_name)
from ..drafters import CrossVocabDrafter, ModelDrafter, PromptLookupDrafter, SuffixDrafter, SuffixModelDrafter
from ..drafters.cross_vocab import across_tokenizers
from ..text.vocab import unwrap_model
from ..engine.generators import AutoregressiveGenerator, SpeculativeGenerator
from ..policy.estimates import expected_tokens
from .costs import measure_costs
from .environment import environment
from .methods.specdecode_plain import run_ours
from .units import Measurement as Record

SCHEMA = "specdecode.advise/1"
MAX_K = 8
MARGIN = 0.05  # a predicted gain under 5 % is within the noise of a short run: not worth drafting for
MEASURE = ("best", "all", "none")
MODEL_DRAFTERS = ("model", "suffix+model")  # the drafters that run the draft model (priced with its costs)
WARMUP_TOKENS = 8


# ----------------------------------------------------------------------------------------------- the arithmetic
@dataclass(frozen=True)
class DraftCost:
    """A drafter's costs in target steps; all 0 for a drafter without a model."""

    step: float = 0.0  # c: a forward of 1 token
    pair: float = 0.0  # c2: a forward of 2 tokens, a step's first after a step that kept every draft
    prefill: float = 0.0  # the forward of a row's prompt, in its first step (mean over the prompts)


def acceptance_of(accepted: list[int], steps: int) -> list[float]:
    """a_j = S_j / S_{j-1}, S_j = accepted[j-1] / steps, S_0 = 1; 0 after a position that was never kept."""
    survival = [1.0] + [a / steps if steps else 0.0 for a in accepted]
    return [s / prev if prev else 0.0 for prev, s in zip(survival, survival[1:])]


def step_time(acceptance: list[float], proposal: list[float], k: int, draft: DraftCost,
              verify: dict[int, float]) -> float:
    """Target steps of a step at K: c per draft proposed (c2 for the first after a full acceptance), and a forward
    of 1 + min(K, L) tokens, where proposal[j-1] = P(L >= j)."""
    offered = [1.0] + list(proposal[:k]) + [0.0]  # P(min(K, L) >= n) for n = 0..K, and 0 beyond K
    all_kept = expected_tokens(acceptance, k) - expected_tokens(acceptance, k - 1)  # S_K = prod a_1..a_K
    drafting = draft.step * sum(offered[1:k + 1]) + (draft.pair - draft.step) * all_kept
    verifying = sum((offered[n] - offered[n + 1]) * verify[n + 1] for n in range(k + 1))
    return drafting + verifying


def predicted_speedup(acceptance: list[float], proposal: list[float], k: int, draft: DraftCost,
                      verify: dict[int, float]) -> float:
    """E(K) / time(K): the long-generation limit."""
    return expected_tokens(acceptance, k) / step_time(acceptance, proposal, k, draft, verify)


def speedup_at_length(acceptance: list[float], proposal: list[float], k: int, draft: DraftCost,
                      verify: dict[int, float], new_tokens: int) -> float:
    """Over a row's new_tokens decoded after its prefill: its steps, and the draft reading the prompt first."""
    steps = new_tokens / expected_tokens(acceptance, k)
    return new_tokens / (steps * step_time(acceptance, proposal, k, draft, verify) + draft.prefill)


def roofline(verify: dict[int, float], max_k: int) -> dict:
    """The best any draft could do here, every draft kept and free: (K + 1) / v(K + 1) at its best K (0: plain)."""
    gains = {k: (k + 1) / verify[k + 1] for k in range(max_k + 1)}
    best = max(gains, key=gains.__getitem__)
    return {"k": best, "speedup": gains[best]}


# ----------------------------------------------------------------------------------------------- the drafters
def drafters_to_try(draft) -> tuple[dict, dict]:
    """({name: draft model or drafter}, {name: why it is left out}): the draft model when there is one, prompt
    lookup, and the suffix drafter; for suffix+MODEL, MODEL alone ("model") and the pair ("suffix+model")."""
    drafters, skipped = {}, {}
    if draft is None:
        skipped["model"] = "no draft model (--draft none)"
    elif isinstance(draft, (PromptLookupDrafter, SuffixDrafter)):
        skipped["model"] = "no draft model (--draft prompt-lookup or suffix)"
    else:
        drafters["model"] = draft.model_drafter if isinstance(draft, SuffixModelDrafter) else draft
    drafters["prompt-lookup"] = PromptLookupDrafter()
    # Advise replays the same prompts (a warm-up, then a run per K): a history would hand each run the answers of
    # the one before, so the suffix drafter drafts from the row's own context only.
    drafters["suffix"] = SuffixDrafter(history_tokens=0)
    if isinstance(draft, SuffixModelDrafter):  # the same model drafter, its suffix part without history too
        drafters["suffix+model"] = SuffixModelDrafter(draft.model_drafter, SuffixDrafter(history_tokens=0),
                                                      draft.min_score)
    return drafters, skipped


def _bridged(target, draft):
    """A draft model of another tokenizer than the target's (alone or suffix+MODEL's) as the CrossVocabDrafter every
    run shares (built once: reading two vocabularies takes seconds); any other draft as it is."""
    if draft is None or isinstance(draft, (PromptLookupDrafter, SuffixDrafter)):
        return draft
    target_tokenizer = unwrap_model(target)[1]
    if isinstance(draft, SuffixModelDrafter):
        return across_tokenizers(draft, draft.model_tokenizer, target_tokenizer)[0]
    model, tokenizer = unwrap_model(draft)
    bridged, _ = across_tokenizers(model, tokenizer, target_tokenizer)
    return bridged if isinstance(bridged, CrossVocabDrafter) else draft


# ----------------------------------------------------------------------------------------------- measuring
def measure_draft_cost(draft_model, prompt_ids: list[list[int]], target_step_s: float, repeats: int) -> dict:
    """The draft model's forwards of 1 and 2 tokens (measure_costs, on the draft as a target) and of each prompt
    (the fastest of two), in ms and as a DraftCost in target steps. draft_model: a model, or a ModelDrafter (its
    backend is timed)."""
    if isinstance(draft_model, CrossVocabDrafter):  # a draft of another tokenizer reads its own tokens of the prompts
        prompt_ids = [draft_model.draft_tokens(ids) for ids in prompt_ids]
    bare = isinstance(draft_model, (ModelDrafter, CrossVocabDrafter))
    alone = AutoregressiveGenerator(draft_model.backend if bare else draft_model)
    costs = measure_costs(alone, prompt_ids[0], [1], repeats)
    prefill = statistics.mean(min(_prompt_seconds(alone.target, ids) for _ in range(2)) for ids in prompt_ids)
    step_s, pair_s = costs["target_step_ms"] / 1000, costs["verify_ms"]["1"] / 1000
    return {"step_ms": 1000 * step_s, "pair_ms": 1000 * pair_s, "prefill_ms": 1000 * prefill,
            "cost": DraftCost(step_s / target_step_s, pair_s / target_step_s, prefill / target_step_s)}


def _prompt_seconds(backend, ids: list[int]) -> float:
    backend.reset(1)
    start = time.perf_counter()
    backend.forward(torch.tensor([ids], dtype=torch.long, device=backend.device), last_only=True)
    if backend.device.type == "cuda":
        torch.cuda.synchronize(backend.device)
    return time.perf_counter() - start


def advise(target, draft, prompt_ids: list[list[int]], max_new_tokens: int = 64, max_k: int = MAX_K,
           temperature: float = 0.0, seed: int = 0, method: str = "leviathan", measure: str = "best",
           cost_repeats: int = 3, progress: Callable[[str], None] | None = None) -> dict:
    """The report (a JSON-ready dict): costs, each drafter's acceptance and predicted (and measured) speedup per
    K in 1..max_k, the roofline and the recommendation. target, draft: what the generators accept (draft may be
    None or a PromptLookupDrafter: the model-free drafters are tried anyway)."""
    if measure not in MEASURE:
        raise ValueError(f"measure must be one of {', '.join(MEASURE)}, got {measure!r}")
    if not prompt_ids or max_new_tokens < 2 or max_k < 1:
        raise ValueError("advise needs prompts, max_new_tokens >= 2 and max_k >= 1")
    progress = progress or (lambda _label: None)
    started = time.time()
    drafters, skipped = drafters_to_try(_bridged(target, draft))
    plain = AutoregressiveGenerator(target)
    costs = measure_costs(plain, prompt_ids[0], list(range(1, max_k + 1)), cost_repeats)
    target_step_s = costs["target_step_ms"] / 1000
    verify = {1: 1.0, **{int(k) + 1: v for k, v in costs["v"].items()}}
    model = drafters.get("model")
    draft_costs = measure_draft_cost(model, prompt_ids, target_step_s, cost_repeats) if model is not None else None
    progress("step costs")
    run = _Runs([[ids] for ids in prompt_ids], max_new_tokens, temperature, seed)
    baseline = run.timed(plain) if measure != "none" else None
    progress("plain decoding")
    setting = _Setting(target, method, max_k, verify, max_new_tokens - 1, run, baseline, measure, progress)
    reports = [_drafter_report(name, drafter, draft_costs["cost"] if name in MODEL_DRAFTERS else DraftCost(),
                               setting) for name, drafter in drafters.items()]
    roof = roofline(verify, max_k)
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": time.time() - started,
        "environment": environment(plain),
        "config": {"max_k": max_k, "max_new_tokens": max_new_tokens, "decode_tokens": max_new_tokens - 1,
                   "temperature": temperature, "seed": seed, "sampler": method, "num_prompts": len(prompt_ids),
                   "prompt_tokens": [len(p) for p in prompt_ids], "measure": measure,
                   "speedup": "decode tokens/s (after the target's prefill) over plain decoding's"},
        "costs": {"target_step_ms": costs["target_step_ms"], "v": {str(n): x for n, x in verify.items()},
                  "verify_ms": {str(int(k) + 1): ms for k, ms in costs["verify_ms"].items()},
                  "repeats": costs["repeats"],
                  "draft": None if draft_costs is None else {**{k: v for k, v in draft_costs.items() if k != "cost"},
                                                              **asdict(draft_costs["cost"])}},
        "plain": _rates(baseline),
        "drafters": reports,
        "skipped": skipped,
        "roofline": roof,
        "recommendation": recommend(reports, roof, verify),
        "draft_auto": draft_auto(draft_costs, verify, costs["target_step_ms"],
                                 CROSS_TOKENIZER_ACCEPTANCE if isinstance(model, CrossVocabDrafter)
                                 else TYPICAL_ACCEPTANCE),
    }


def draft_auto(draft_costs: dict | None, verify: dict[int, float], target_step_ms: float,
               acceptance: float = TYPICAL_ACCEPTANCE) -> dict | None:
    """What `--draft auto` decides from these costs (draft_choice.choose_draft, the same arithmetic; acceptance:
    what the model must pay at, a draft of another tokenizer's lower one), and the costs as it records them; None
    without a draft model."""
    if draft_costs is None:
        return None
    costs = DraftCosts(draft_costs["cost"].step, dict(verify), target_step_ms, datetime.date.today().isoformat(),
                       machine_name())
    choice = choose_draft("MODEL", costs, acceptance=acceptance)
    return {"draft": choice.draft, "model_can_pay": choice.uses_model, "text": choice.reason,
            "costs": costs.to_dict()}


class _Runs:
    """Decodes the prompts one at a time with a generator: untimed (for acceptance) or after a short warm-up."""

    def __init__(self, batches: list, max_new_tokens: int, temperature: float, seed: int):
        self.batches, self.max_new_tokens, self.temperature, self.seed = batches, max_new_tokens, temperature, seed

    def once(self, generator) -> Record:
        return run_ours(generator, self.batches, self.max_new_tokens, self.temperature, 0, 1.0, self.seed)

    def timed(self, generator) -> Record:
        run_ours(generator, self.batches[:1], WARMUP_TOKENS, self.temperature, 0, 1.0, self.seed)
        return self.once(generator)


@dataclass(frozen=True)
class _Setting:
    """What every drafter's measurement shares."""

    target: object
    method: str
    max_k: int
    verify: dict  # n -> v(n)
    decode_tokens: int  # new tokens of a row after its prefill's
    run: _Runs
    baseline: Record | None  # plain decoding's run; None: nothing is timed (measure="none")
    measure: str
    progress: Callable[[str], None]


def _drafter_report(name: str, drafter, draft: DraftCost, setting: _Setting) -> dict:
    """One drafter: a run at max_k for its acceptance, the prediction per K, and the measured Ks."""
    max_k, verify, run, baseline = setting.max_k, setting.verify, setting.run, setting.baseline

    def generator(k: int):
        return SpeculativeGenerator(setting.target, drafter, num_speculative_tokens=k, method=setting.method)

    before = _steps(drafter)
    widest = run.timed(generator(max_k)) if baseline is not None else run.once(generator(max_k))
    draft, model_share = _model_share(drafter, draft, before)
    setting.progress(f"{name} K={max_k}")
    stats = widest.stats
    steps = stats.verification_steps
    accepted = _padded(stats.accepted_per_position, max_k)
    proposed = _padded(stats.proposed_per_position, max_k)
    acceptance = acceptance_of(accepted, steps)
    proposal = [p / steps if steps else 0.0 for p in proposed]
    by_k = [_prediction(k, acceptance, proposal, draft, verify, setting.decode_tokens, baseline)
            for k in range(1, max_k + 1)]
    best = max(by_k, key=lambda row: row["speedup_at_length"])
    measured = {max_k: widest}
    if baseline is not None:
        wanted = range(1, max_k) if setting.measure == "all" else [best["k"]] if best["k"] != max_k else []
        for k in wanted:
            measured[k] = run.timed(generator(k))
            setting.progress(f"{name} K={k}")
    for row in by_k:
        row.update(_measured(measured.get(row["k"]), baseline))
    return {"name": name, "draft_step_cost": draft.step, "draft_pair_cost": draft.pair,
            "draft_prefill_cost": draft.prefill, "model_step_share": model_share, "steps": steps,
            "accepted_per_position": accepted, "proposed_per_position": proposed,
            "acceptance": acceptance, "proposal": proposal, "acceptance_rate": stats.acceptance_rate,
            "by_k": by_k, "best_k": best["k"], "best_speedup": best["speedup_at_length"]}


def _steps(drafter) -> tuple[int, int] | None:
    """suffix+MODEL's (model steps, free steps) so far; None for any other drafter."""
    if not isinstance(drafter, SuffixModelDrafter):
        return None
    return drafter.counts.model_steps, drafter.counts.free_steps


def _model_share(drafter, draft: DraftCost, before: tuple[int, int] | None) -> tuple[DraftCost, float | None]:
    """suffix+MODEL runs its model only on steps where some row does not copy: its draft step costs are the
    model's times the share of such steps in the run at max_k (an approximation: a copy may offer other than K
    drafts); its prompt is read as the model's. Any other drafter: its costs as they are."""
    if before is None:
        return draft, None
    model, free = (now - then for now, then in zip(_steps(drafter), before))
    share = model / (model + free) if model + free else 1.0
    return DraftCost(draft.step * share, draft.pair * share, draft.prefill), share


def _prediction(k: int, acceptance: list[float], proposal: list[float], draft: DraftCost, verify: dict,
                decode_tokens: int, baseline: Record | None) -> dict:
    at_length = speedup_at_length(acceptance, proposal, k, draft, verify, decode_tokens)
    return {"k": k, "expected_tokens": expected_tokens(acceptance, k),
            "step_time": step_time(acceptance, proposal, k, draft, verify),
            "speedup": predicted_speedup(acceptance, proposal, k, draft, verify), "speedup_at_length": at_length,
            "expected_end_to_end_speedup": _end_to_end(at_length, baseline)}


def _padded(counts: list[int], width: int) -> list[int]:
    return list(counts[:width]) + [0] * (width - len(counts))


def _rates(record: Record | None) -> dict | None:
    if record is None:
        return None
    return {"tokens_per_second": record.tokens_per_second,
            "decode_tokens_per_second": record.stats.decode_tokens_per_second,
            "prefill_time_s": record.stats.prefill_time_s,
            "decode_time_s": record.stats.wall_time_s - record.stats.prefill_time_s}


def _end_to_end(speedup: float, baseline: Record | None) -> float | None:
    """With the target's prefill counted (as `specdecode bench` reports tokens/s): plain decoding's measured prefill
    and decode times, against the same prefill and the decode time divided by the speedup."""
    if baseline is None:
        return None
    plain = _rates(baseline)
    return (plain["prefill_time_s"] + plain["decode_time_s"]) / \
        (plain["prefill_time_s"] + plain["decode_time_s"] / speedup)


def _measured(record: Record | None, baseline: Record | None) -> dict:
    """The measured speedup of a run over plain decoding (decode and end to end), None where not measured."""
    if record is None or baseline is None:
        return {"measured_speedup": None, "measured_end_to_end_speedup": None}
    plain = _rates(baseline)
    decode, whole = record.stats.decode_tokens_per_second, record.tokens_per_second
    return {"measured_speedup": decode / plain["decode_tokens_per_second"]
            if plain["decode_tokens_per_second"] else None,
            "measured_end_to_end_speedup": whole / plain["tokens_per_second"] if plain["tokens_per_second"] else None}


# ----------------------------------------------------------------------------------------------- the advice
def recommend(reports: list[dict], roof: dict, verify: dict[int, float]) -> dict:
    """The best drafter and K when it beats plain decoding by more than MARGIN, else plain decoding and why."""
    best = max(reports, key=lambda r: r["best_speedup"], default=None)
    if best is not None and best["best_speedup"] >= 1 + MARGIN:
        k = best["best_k"]
        return {"drafter": best["name"], "k": k, "expected_speedup": best["best_speedup"],
                "text": f"{best['name']} drafts, K={k}: {best['best_speedup']:.2f}× expected"
                        f"{_flags(best['name'], k)}"}
    return {"drafter": None, "k": 0, "expected_speedup": 1.0,
            "text": "plain decoding: " + _why_plain(best, roof, verify)}


def _flags(name: str, k: int) -> str:
    flags = {"model": f"-k {k}", "prompt-lookup": f"--draft prompt-lookup -k {k}",
             "suffix": f"--draft suffix -k {k}", "suffix+model": f"--draft suffix+MODEL -k {k}"}.get(name)
    return f" ({flags}; -k auto finds it too)" if flags else ""


def _why_plain(best: dict | None, roof: dict, verify: dict[int, float]) -> str:
    top = max(verify)
    costs = f"a forward of 2 tokens costs {verify[2]:.2f} target steps, of {top} tokens {verify[top]:.2f}"
    ceiling = f"drafts always kept and free would give at most {roof['speedup']:.2f}×"
    if roof["speedup"] < 1 + MARGIN:
        return f"no draft can pay on this machine: {costs}, so even {ceiling}"
    if best is None:
        return f"no drafter to try; {ceiling} here ({costs})"
    k, offered = best["best_k"], best["proposal"][0]
    if best["draft_step_cost"]:
        detail = (f"{_percent(best['acceptance'][0])} of first drafts kept, a draft step costs "
                  f"{best['draft_step_cost']:.2f} target steps")
    else:  # a model-free drafter often has nothing to offer: its acceptance counts those steps as misses
        kept = best["acceptance"][0] / offered if offered else 0.0
        detail = f"drafts offered on {_percent(offered)} of steps, {_percent(kept)} of first drafts kept"
    return f"the best drafter, {best['name']} at K={k}, would give {best['best_speedup']:.2f}× ({detail}); {ceiling}"


def _percent(x: float) -> str:
    return f"{100 * x:.0f} %"
