"""transformers' generate() as the bench runs it: every sampling knob explicit, min_new_tokens = max_new_tokens
(exactly as many tokens as ours), rows left-padded, and for assisted generation the draft's settings pinned
and its forward calls counted. Shared by hf-plain and hf-assisted."""

from __future__ import annotations

import contextlib
import time

from ..units import AUTO, Measurement

def generation_config(model, tokenizer, max_new_tokens: int, temperature: float, top_k: int, top_p: float):
    from transformers import GenerationConfig

    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None:
        pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    greedy = temperature == 0
    # Every sampling knob is given explicitly: unset ones would be filled from the model's generation_config
    # (often temperature 0.7, top_k 20, repetition_penalty 1.05 for instruct models) or transformers' defaults
    # (top_k 50), and transformers would then sample from another distribution than ours.
    return GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=not greedy, num_beams=1,
        temperature=1.0 if greedy else float(temperature), top_k=50 if greedy else int(top_k),
        top_p=1.0 if greedy else float(top_p), repetition_penalty=1.0, eos_token_id=eos, pad_token_id=pad,
        use_cache=True)


@contextlib.contextmanager
def assistant_settings(draft_model, k):
    """Make transformers' assisted generation draft exactly k tokens per step, then restore the draft's config.

    num_assistant_tokens = k with the "constant" schedule (the "heuristic" one changes K as it goes), and
    assistant_confidence_threshold = 0 (its default 0.4 stops drafting early when the draft is unsure). k = "auto":
    transformers' own defaults, its dynamic setting; it adapts the threshold during a call and keeps it in the
    draft's config, so every call starts again from the defaults.
    """
    config = draft_model.generation_config
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    saved = {n: getattr(config, n, None) for n in names}
    values = (None, None, None) if k == AUTO else (k, "constant", 0.0)
    for n, value in zip(names, values):
        setattr(config, n, value)
    try:
        yield
    finally:
        for n, value in saved.items():
            setattr(config, n, value)


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' warnings about its own internal calls (assisted generation passes both a
    generation_config and kwargs to the assistant's generate), which say nothing about this benchmark."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def count_forwards(module, counter: list[int]):
    handle = module.register_forward_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    try:
        yield
    finally:
        handle.remove()


def transformers_model(obj):
    """The transformers model behind obj (a model, or what load_model returns); None for any other backend."""
    from transformers import PreTrainedModel

    model = getattr(obj, "model", obj)
    return model if isinstance(model, PreTrainedModel) else None


def _left_padded(rows: list[list[int]], pad: int, device):
    """(input_ids, attention_mask) of ragged rows, padded on the left as transformers' generate() wants."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[b, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def run_hf(model, tokenizer, batches: list[list[list[int]]], max_new_tokens: int, temperature: float, top_k: int,
           top_p: float, seed: int, assistant=None, k: int | str | None = None,
           prompt_lookup: int | None = None) -> Measurement:
    """transformers' generate() on each batch (rows left-padded; assisted generation takes one row)."""
    import torch
    from transformers import DynamicCache

    from ...backends.hf import cache_keyword

    device = next(model.parameters()).device
    config = generation_config(model, tokenizer, max_new_tokens, temperature, top_k, top_p)
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cache_name = cache_keyword(model.forward)
    per_tokens, per_seconds = [], []
    target_calls, draft_calls = [0], [0]
    for i, rows in enumerate(batches):
        input_ids, attention_mask = _left_padded(rows, config.pad_token_id, device)
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "generation_config": config,
                  cache_name: DynamicCache(config=text_config)}
        ctx = contextlib.ExitStack()
        if prompt_lookup is not None:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup
            ctx.enter_context(count_forwards(model, target_calls))
        if assistant is not None:
            kwargs["assistant_model"] = assistant
            ctx.enter_context(assistant_settings(assistant, k))
            ctx.enter_context(count_forwards(model, target_calls))
            ctx.enter_context(count_forwards(assistant, draft_calls))
        with ctx, quiet_transformers():
            torch.manual_seed(seed + i)
            t0 = time.perf_counter()
            output = model.generate(**kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            per_seconds.append(time.perf_counter() - t0)
        new = output[:, input_ids.shape[1]:]
        # rows are padded after an end of generation only when transformers stops early, which min_new_tokens
        # forbids: every row's count is the width of the new part
        per_tokens += [int(new.shape[1])] * len(rows)
    return Measurement(sum(per_tokens), sum(per_seconds), per_tokens, per_seconds, target_calls=target_calls[0],
                       draft_calls=draft_calls[0])
