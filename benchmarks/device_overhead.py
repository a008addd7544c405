"""The device check's "overhead" section: the engine at a known acceptance (replay_drafter.py: the target's own
greedy continuation with errors at rate 1 - alpha, a draft model paying real draft costs), K fixed and auto, batch 1
and 4, against plain decoding and against Leviathan's prediction from v(n) and c measured just before; per backend
variant, the static backend's CUDA graphs first (known to work, cheap to warm), then the compiled step (warmed up
on the shapes this run needs: every compile timed, device_compiled.timed_warm_up). Transformers' assisted
generation beside ours at acceptance 1 (plan.assisted)."""

from __future__ import annotations

import statistics
import time

from .device_sections import Deadline, Plan, _device, _dtype, _static, _sync, best_k, forward_costs, leviathan


def _timed(fn, device, repeats: int = 2):
    """(median seconds, last result) of `repeats` calls after one warm-up (which also captures CUDA graphs)."""
    out, times = fn(), []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def section_overhead(plan: Plan, deadline: Deadline, journal) -> dict:
    """Ours at known acceptance against plain decoding and Leviathan's prediction, per variant of the static backend;
    then transformers' assisted generation beside ours with a draft that is always right (both models copy their
    current token)."""
    import gc

    import torch

    from .device_compiled import VARIANTS, timed_warm_up
    from .random_models import SHAPES, build_qwen

    device, dtype, max_k = _device(plan), _dtype(plan.dtype), 8
    # copying models: their greedy continuation survives half-precision rounding (random_models.build_qwen)
    journal.log(f"building {plan.target} and {plan.draft}")
    target = build_qwen(plan.target, device, dtype, seed=0, copying=True)
    draft = build_qwen(plan.draft, device, dtype, seed=1, copying=True)
    vocab = min(SHAPES[plan.target][5], SHAPES[plan.draft][5])  # the 7B shape's output layer has 128 more rows
    tokens = plan.context + plan.new_tokens + max_k + 2
    journal.put("target", plan.target)
    journal.put("draft", plan.draft)
    rows, assisted, warm_ups = [], [], []
    top = max(plan.overhead_batches)
    for variant in plan.overhead_variants:
        if deadline.passed():
            break
        # One backend per model for every batch size, as a server holds them: compiled graphs and CUDA graphs are
        # per backend, so a backend per batch would compile again.
        backends = {name: _static(model, plan, top, tokens, vocab, VARIANTS[variant]["compile"])
                    for name, model in (("target", target), ("draft", draft))}
        if backends["target"].compile_mode:
            for name, backend in backends.items():
                # only the spans this run reaches: from the prompt's on (a server warms every span; the compiled
                # section times that)
                first = backend.step_shape(1, 1, plan.context)[2]
                shapes = [s for s in _shapes(backend, plan.overhead_batches) if s[2] >= first]
                warm = timed_warm_up(backend, shapes, plan.overhead_warmup_seconds, journal, f"{variant} {name}")
                warm_ups.append({"variant": variant, "model": name, "compile_mode": backend.compile_mode, **warm})
                journal.add("warm_ups", warm_ups[-1])
        for batch in plan.overhead_batches:
            if deadline.passed():
                break
            rows += _batch_rows(plan, variant, batch, backends, vocab, max_k, device, deadline, journal)
            if batch == 1 and plan.assisted and not assisted and not deadline.passed():
                prompts = _prompts(vocab, batch, plan.context)
                assisted = _assisted(target, draft, prompts, plan, device, deadline)
                for row in assisted:
                    journal.add("assisted", row)
        del backends
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"target": plan.target, "draft": plan.draft, "dtype": plan.dtype, "new_tokens": plan.new_tokens,
            "context": plan.context, "variants": list(plan.overhead_variants), "warm_ups": warm_ups, "rows": rows,
            "assisted": assisted,
            "goal": "ratio = measured speedup / Leviathan's prediction >= 0.9"}


def _shapes(backend, batches):
    from specdecode.backends.warmup import step_shapes

    return step_shapes(backend, batches)


def _prompts(vocab: int, batch: int, context: int) -> list[list[int]]:
    import torch

    return torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(3)).tolist()


def _batch_rows(plan: Plan, variant: str, batch: int, backends: dict, vocab: int, max_k: int, device, deadline,
                journal) -> list[dict]:
    """v(n) and c on these backends, plain decoding, then every (alpha, K) at this batch size."""
    from specdecode import AutoregressiveGenerator, SpeculativeGenerator
    from specdecode.drafters.model import ModelDrafter

    from .replay_drafter import ReplayDrafter

    target_backend, draft_backend = backends["target"], backends["draft"]
    prompts = _prompts(vocab, batch, plan.context)
    costs = forward_costs(target_backend, batch, plan.context, range(1, max_k + 2), plan.repeats, deadline, vocab)
    d1 = forward_costs(draft_backend, batch, plan.context, [1], plan.repeats, deadline, vocab)[1]
    v, c = {n: s / costs[1] for n, s in costs.items()}, d1 / costs[1]
    journal.log(f"{variant} batch {batch}: v(n) and c measured (target step {1000 * costs[1]:.2f} ms, c {c:.3f})")
    new = dict(max_new_tokens=plan.new_tokens, temperature=0.0, ignore_eos=True)
    plain_s, plain = _timed(lambda: AutoregressiveGenerator(target_backend).generate(prompts, **new), device)
    plain_tps = batch * plan.new_tokens / plain_s
    journal.log(f"{variant} batch {batch}: plain {plain_tps:.1f} tok/s")
    record, rows = plain.token_ids, []
    for alpha in plan.alphas:
        for k in (plan.fixed_k, "auto"):
            if deadline.passed():
                return rows
            drafters = []

            def run():
                drafter = ReplayDrafter(record, alpha, vocab, seed=batch, model=ModelDrafter(draft_backend))
                drafters.append(drafter)
                generator = SpeculativeGenerator(target_backend, drafter, num_speculative_tokens=k,
                                                 max_speculative_tokens=max_k)
                return generator.generate(prompts, **new)

            seconds, result = _timed(run, device)
            stats = result.stats
            predicted_k, predicted = (k, leviathan(alpha, k, c, v)) if k != "auto" else best_k(alpha, c, v, max_k)
            measured = plain_s / seconds
            rows.append({"variant": variant, "batch": batch, "alpha": alpha, "k": k, "predicted_best_k": predicted_k,
                         "tokens_per_s": batch * plan.new_tokens / seconds, "plain_tokens_per_s": plain_tps,
                         "speedup": measured, "predicted_speedup": predicted, "ratio": measured / predicted,
                         "acceptance": stats.accepted_tokens / max(1, stats.proposed_tokens),
                         "first_draft_acceptance": (stats.accepted_per_position[0] / stats.proposed_per_position[0]
                                                    if stats.proposed_per_position
                                                    and stats.proposed_per_position[0] else None),
                         "k_histogram": {str(a): b for a, b in stats.k_histogram.items()},
                         "same_as_plain": result.token_ids == record,
                         "off_record_tokens": drafters[-1].off_record, "c": c,
                         "v": {n: round(x, 4) for n, x in v.items()}})
            journal.add("rows", rows[-1])
            journal.log(f"{variant} batch {batch} alpha {alpha} K {k}: {measured:.2f}x plain, ratio "
                        f"{measured / predicted:.2f}")
    return rows


def _assisted(target, draft, prompts, plan: Plan, device, deadline: Deadline) -> list[dict]:
    """transformers generate() and assisted generation (K fixed, constant schedule) against ours on the transformers
    backend, one row, both models copying (acceptance 1); each against its own plain decoding and the prediction."""
    import torch

    from specdecode import AutoregressiveGenerator, SpeculativeGenerator
    from specdecode.backends.hf import HFBackend

    k, ids = plan.fixed_k, torch.tensor(prompts, device=device)
    hf = dict(max_new_tokens=plan.new_tokens, min_new_tokens=plan.new_tokens, do_sample=False, pad_token_id=0)
    new = dict(max_new_tokens=plan.new_tokens, temperature=0.0, ignore_eos=True)
    vocab = target.config.vocab_size
    t = forward_costs(HFBackend(target), 1, plan.context, range(1, k + 2), plan.repeats, deadline, vocab)
    d1 = forward_costs(HFBackend(draft), 1, plan.context, [1], plan.repeats, deadline, vocab)[1]
    v, c = {n: s / t[1] for n, s in t.items()}, d1 / t[1]
    predicted = leviathan(1.0, k, c, v)
    runs = {
        "transformers": (lambda: target.generate(ids, **hf)[:, ids.shape[1]:].tolist(),
                         lambda: target.generate(ids, assistant_model=draft, num_assistant_tokens=k,
                                                 num_assistant_tokens_schedule="constant", **hf)[:, ids.shape[1]:]
                         .tolist()),
        "ours (transformers backend)": (
            lambda: AutoregressiveGenerator(HFBackend(target)).generate(prompts, **new).token_ids,
            lambda: SpeculativeGenerator(HFBackend(target), HFBackend(draft), num_speculative_tokens=k)
            .generate(prompts, **new).token_ids),
    }
    out = []
    for name, (plain_fn, spec_fn) in runs.items():
        if deadline.passed():
            break
        plain_s, plain = _timed(plain_fn, device)
        spec_s, spec = _timed(spec_fn, device)
        out.append({"method": name, "k": k, "plain_tokens_per_s": plan.new_tokens / plain_s,
                    "tokens_per_s": plan.new_tokens / spec_s, "speedup": plain_s / spec_s,
                    "predicted_speedup": predicted, "ratio": plain_s / spec_s / predicted, "c": c,
                    "same_as_plain": spec == plain})
    return out
