"""`specdecode bench`: our loop against transformers, in one process, on the same prompts and settings.

Methods (all decode the same target, one prompt at a time, the same number of new tokens per prompt):
- specdecode-plain: our decoding loop without a draft (AutoregressiveGenerator),
- specdecode:       our speculative decoding (SpeculativeGenerator) with the draft and K (a number, or "auto": the
                    engine's adaptive K),
- hf-plain:         transformers `generate()` (greedy or sampling, DynamicCache),
- hf-assisted:      transformers assisted generation with the SAME draft object and the same K, constant schedule
                    and the confidence-threshold early stop disabled, so it drafts exactly K tokens per step; for
                    K = "auto", transformers' own dynamic setting (its defaults: up to 20 drafts, stopped early
                    when the draft's confidence falls under an adaptive threshold),
- llamacpp-plain:   llama-cpp-python's own generation loop on the target's GGUF file, same threads,
- llamacpp-prompt-lookup: the same with llama-cpp-python's LlamaPromptLookupDecoding drafting K tokens (K = auto:
                    its own default, 10),
- llama-speculative (one method per --llama-draft-max N, named llama-speculative-dmaxN): llama.cpp's
                    llama-speculative binary on the target and draft GGUF files (see bench/llamacpp_peers.py).
The llama.cpp methods need a GGUF target (a built-in model or a .gguf file), whatever backend ours run on.

Batches (--batch-size N): every generate() call gets N rows (consecutive prompts, the set cycled to fill the last
batch); ours and hf-plain decode them together (tokens/s summed over rows), llama.cpp's methods one after another,
and transformers' assisted generation, which takes one row, is left out.

Our methods go through the engine and the ModelBackend interface only (the step costs too), so they run on any
backend; transformers' methods need transformers models and are left out (with a note) for other backends.

Lengths: our engine runs with ignore_eos=True; transformers with min_new_tokens = max_new_tokens, so every method
emits exactly max_new_tokens tokens per prompt (checked, and reported in `lengths_match`).

Runs are interleaved (A B C D A B C D ...) after a warm-up, so drift of a shared machine hits every method alike.
Throughput is end to end (prefill included, as in a user's call): new tokens / wall time of the generate() calls.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..chat import encode_chat, has_chat_template
from ..engine import AutoregressiveGenerator, SpeculativeGenerator
from ..results import Stats
from . import stats as st
from .llamacpp_peers import LOOKUP_DEFAULT_TOKENS, LlamaCppPeers, SpeculativeBinary
from .stats import merge_stats

METHODS = ("specdecode-plain", "specdecode", "hf-plain", "hf-assisted", "llamacpp-plain", "llamacpp-prompt-lookup",
           "llama-speculative")
SPECULATIVE = ("specdecode", "hf-assisted", "llamacpp-prompt-lookup")  # timed once per K
LLAMACPP = ("llamacpp-plain", "llamacpp-prompt-lookup", "llama-speculative")
PLAIN_OF = {"specdecode": "specdecode-plain", "hf-assisted": "hf-plain", "llamacpp-prompt-lookup": "llamacpp-plain"}
SCHEMA = "specdecode.bench/1"
AUTO = "auto"


@dataclass
class BenchSettings:
    ks: list = field(default_factory=lambda: [AUTO])  # numbers of draft tokens per step, or "auto"
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    max_new_tokens: int = 64
    runs: int = 3
    warmup: int = 1
    top_k: int = 0
    top_p: float = 1.0
    methods: tuple[str, ...] = METHODS
    seed: int = 0
    method: str = "leviathan"  # our rejection sampler
    cost_repeats: int = 3
    batch_size: int = 1  # rows per generate() call
    llama_draft_max: list[int] = field(default_factory=lambda: [2, 3, 4, 8])  # llama-speculative --draft-max values

    def check(self) -> None:
        if not self.ks or any(k != AUTO and (isinstance(k, bool) or not isinstance(k, int) or k < 1)
                              for k in self.ks):
            raise ValueError(f"K values must be 'auto' or integers >= 1, got {self.ks}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        if self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        if self.runs < 1:
            raise ValueError("--runs must be >= 1")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not self.llama_draft_max or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                           for n in self.llama_draft_max):
            raise ValueError(f"--llama-draft-max values must be integers >= 1, got {self.llama_draft_max}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown}: choose among {', '.join(METHODS)}")


@dataclass
class Record:
    """One run of one method over all prompts.

    per_prompt_tokens: new tokens of each row; per_prompt_seconds: wall time of each generate() call (one per
    prompt, or per batch under --batch-size)."""

    tokens: int
    seconds: float
    per_prompt_tokens: list[int]
    per_prompt_seconds: list[float]
    stats: Stats | None = None  # ours: merged over the prompts
    target_calls: int = 0  # hf-assisted: forward calls counted with hooks
    draft_calls: int = 0
    extra: dict = field(default_factory=dict)  # llama-speculative: what it printed

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.seconds / self.tokens if self.tokens else float("nan")


def encode_prompts(tokenizer, texts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when asked and the tokenizer has one.

    Every method gets these same ids, so no method tokenizes differently from another.
    """
    if tokenizer is None:
        raise ValueError("bench needs the target's tokenizer to encode its prompts")
    encoded = []
    for text in texts:
        if chat and has_chat_template(tokenizer):
            ids = encode_chat(tokenizer, text)
        else:
            ids = tokenizer(text)["input_ids"]
        if not ids:
            raise ValueError("a prompt encodes to no tokens")
        encoded.append(list(ids))
    return encoded


def make_batches(prompt_ids: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """Consecutive prompts in batches of batch_size rows; the set is cycled to fill the last batch, so every
    generate() call has the same number of rows."""
    batches = []
    for start in range(0, len(prompt_ids), batch_size):
        batches.append([prompt_ids[(start + j) % len(prompt_ids)] for j in range(batch_size)])
    return batches


def int_ks(ks) -> list[int]:
    """The fixed K values of a list that may hold "auto"."""
    return [k for k in ks if k != AUTO]


# ----------------------------------------------------------------------------------------------- step costs
def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return st.summarize(times)["median"]


def measure_costs(generator, prompt_ids: list[int], ks: list[int], repeats: int = 3) -> dict:
    """Forward costs on a warm cache (the prompt prefilled), on the generator's own backends.

    target_step_ms: a 1-token target forward; verify_ms[K]: a (K+1)-token target forward; draft_step_ms: a
    1-token forward of the draft model (none for a model-free drafter). c = draft step / target step; v[K] =
    verify / target step. Each is the median of `repeats` forwards after one untimed warm-up, with the cache
    trimmed back after every forward. Only the ModelBackend interface is used (reset, forward, trim, lengths).
    """
    repeats = max(1, repeats)
    draft = getattr(generator.drafter, "backend", None)  # a draft model's backend; None for prompt lookup

    def backend_timer(backend):
        device = backend.device
        backend.reset(1)
        backend.forward(torch.tensor([prompt_ids], dtype=torch.long, device=device), last_only=True)
        base = backend.lengths

        def step(n: int):
            ids = torch.tensor([[prompt_ids[i % len(prompt_ids)] for i in range(n)]], dtype=torch.long,
                               device=device)

            def run():
                backend.forward(ids)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                backend.trim(base)

            run()  # warm-up
            return _median_time(run, repeats)

        return step

    target_step = backend_timer(generator.target)
    t1 = target_step(1)
    verify = {k: target_step(k + 1) for k in sorted(set(ks))}
    result = {"repeats": repeats, "prompt_tokens": len(prompt_ids), "target_step_ms": 1000 * t1,
              "verify_ms": {str(k): 1000 * t for k, t in verify.items()},
              "v": {str(k): t / t1 for k, t in verify.items()}, "draft_step_ms": None, "c": None}
    if draft is not None:
        d1 = backend_timer(draft)(1)
        result.update(draft_step_ms=1000 * d1, c=d1 / t1)
    return result


def cost_ks(ks: list, auto_max: int) -> list[int]:
    """K values whose verification cost is measured: those asked for, 1..4, and 1..max under "auto"."""
    top = max(int_ks(ks) + [4] + ([auto_max] if AUTO in ks else []))
    return sorted(set(int_ks(ks)) | set(range(1, top + 1)))


# ----------------------------------------------------------------------------------------------- transformers
def _hf_generation_config(model, tokenizer, max_new_tokens: int, temperature: float, top_k: int, top_p: float):
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
def _quiet_transformers():
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


def _left_padded(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ragged rows, padded on the left as transformers' generate() wants."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[b, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def run_hf(model, tokenizer, batches: list[list[list[int]]], max_new_tokens: int, temperature: float, top_k: int,
           top_p: float, seed: int, assistant=None, k: int | None = None, prompt_lookup: int | None = None) -> Record:
    """transformers' generate() on each batch (rows left-padded; assisted generation takes one row)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    config = _hf_generation_config(model, tokenizer, max_new_tokens, temperature, top_k, top_p)
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    per_tokens, per_seconds = [], []
    target_calls, draft_calls = [0], [0]
    for i, rows in enumerate(batches):
        input_ids, attention_mask = _left_padded(rows, config.pad_token_id, device)
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "generation_config": config,
                  "past_key_values": DynamicCache(config=text_config)}
        ctx = contextlib.ExitStack()
        if prompt_lookup is not None:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup
            ctx.enter_context(count_forwards(model, target_calls))
        if assistant is not None:
            kwargs["assistant_model"] = assistant
            ctx.enter_context(assistant_settings(assistant, k))
            ctx.enter_context(count_forwards(model, target_calls))
            ctx.enter_context(count_forwards(assistant, draft_calls))
        with ctx, _quiet_transformers():
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
    return Record(sum(per_tokens), sum(per_seconds), per_tokens, per_seconds, target_calls=target_calls[0],
                  draft_calls=draft_calls[0])


def run_ours(generator, batches: list[list[list[int]]], max_new_tokens: int, temperature: float, top_k: int,
             top_p: float, seed: int) -> Record:
    """Our generator on each batch (its rows decoded together)."""
    per_tokens, per_seconds, all_stats = [], [], []
    for i, rows in enumerate(batches):
        t0 = time.perf_counter()
        result = generator.generate([list(r) for r in rows], max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_k=top_k, top_p=top_p, seed=seed + i, ignore_eos=True)
        per_seconds.append(time.perf_counter() - t0)
        per_tokens += [len(t) for t in result.token_ids]
        all_stats.append(result.stats)
    return Record(sum(per_tokens), sum(per_seconds), per_tokens, per_seconds, stats=merge_stats(all_stats))


# ----------------------------------------------------------------------------------------------- llama.cpp
@dataclass
class LlamaPeerSetup:
    """What llama.cpp's methods run on: the GGUF files of our target and draft (None when a model is not a GGUF),
    the threads, and the llama-speculative binary (None: that method is not run)."""

    target_gguf: str | None
    draft_gguf: str | None = None
    threads: int | None = None
    speculative_binary: str | None = None


def run_llamacpp(peers, batches: list[list[list[int]]], max_new_tokens: int, temperature: float, top_k: int,
                 top_p: float, seed: int, lookup: int | None = None) -> Record:
    """llama-cpp-python's own generation (LlamaCppPeers), every row one after another."""
    per_tokens, per_seconds = [], []
    for i, rows in enumerate(batches):
        seconds = 0.0
        for j, ids in enumerate(rows):
            n, t = peers.generate(ids, max_new_tokens, temperature, top_k, top_p, seed + i * len(rows) + j, lookup)
            per_tokens.append(n)
            seconds += t
        per_seconds.append(seconds)
    return Record(sum(per_tokens), sum(per_seconds), per_tokens, per_seconds)


def run_llama_speculative(binary, setup: LlamaPeerSetup, tokenizer, batches: list[list[list[int]]],
                          max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
                          draft_max: int, n_ctx: int) -> Record:
    """llama.cpp's llama-speculative binary on each row, one after another; the prompt is our token ids written
    back as text (special tokens included), which it tokenizes itself."""
    from .llamacpp_peers import write_prompt

    per_tokens, per_seconds, runs = [], [], []
    for i, rows in enumerate(batches):
        seconds = 0.0
        for j, ids in enumerate(rows):
            prompt = write_prompt(tokenizer.decode(ids, skip_special_tokens=False))
            try:
                run, cmd = binary.run(Path(setup.target_gguf), Path(setup.draft_gguf), prompt, max_new_tokens,
                                      draft_max, setup.threads, n_ctx, temperature, top_k, top_p,
                                      seed + i * len(rows) + j)
            finally:
                os.unlink(prompt)
            per_tokens.append(run.new_tokens)
            seconds += run.seconds
            runs.append(run)
        per_seconds.append(seconds)
    drafted = [r.n_drafted for r in runs if r.n_drafted is not None]
    accepted = [r.n_accept for r in runs if r.n_accept is not None]
    extra = {"command": cmd, "prompt_tokens": [r.prompt_tokens for r in runs],
             "decode_tokens_per_second": [r.decode_tokens_per_second for r in runs],
             "n_drafted": sum(drafted) if drafted else None, "n_accept": sum(accepted) if accepted else None}
    return Record(sum(per_tokens), sum(per_seconds), per_tokens, per_seconds, extra=extra)


def _llama_ctx(prompt_ids: list[list[int]], max_new_tokens: int, extra: int) -> int:
    """A context that holds the longest prompt, the new tokens and a step of drafts, rounded up to 256: Llama with
    a draft keeps the logits of every position (n_ctx x vocabulary floats), so it stays small."""
    need = max(len(p) for p in prompt_ids) + max_new_tokens + extra + 16
    return 256 * math.ceil(need / 256)


# ----------------------------------------------------------------------------------------------- the benchmark
@dataclass(frozen=True)
class Unit:
    """One thing that is timed: a method, at a temperature, with a K for the speculative ones."""

    method: str
    temperature: float
    k: int | str | None = None
    draft_max: int | None = None  # llama-speculative's --draft-max

    @property
    def name(self) -> str:
        """The method's name in the report: llama-speculative gets its draft-max (llama-speculative-dmax4)."""
        return self.method + (f"-dmax{self.draft_max}" if self.draft_max is not None else "")

    @property
    def label(self) -> str:
        return self.name + (f" K={self.k}" if self.k is not None else "") + f" T={self.temperature:g}"


class Bench:
    """Holds the generators and the models transformers' methods run on; `run()` produces the report (a JSON-ready
    dict). target and draft: what the generators accept (what load_model returns, a transformers model, a
    ModelBackend; the draft may also be a Drafter)."""

    def __init__(self, target, draft, prompt_ids: list[list[int]], settings: BenchSettings,
                 info: dict | None = None, peer_target=None, peer_draft=None, llama: LlamaPeerSetup | None = None):
        """peer_target / peer_draft: the models transformers' methods run on, when they differ from ours (a
        transformers user loads plain fp32 models, without our prepacking or draft quantization). llama: the
        GGUF files, threads and binary llama.cpp's methods run on (None: they are left out)."""
        settings.check()
        self.prompt_ids = prompt_ids
        self.batches = make_batches(prompt_ids, settings.batch_size)
        self.settings = settings
        self.info = dict(info or {})
        self.hf_target = transformers_model(peer_target or target)
        self.hf_draft = transformers_model(peer_draft or draft) if draft is not None else None
        self.llama_setup = llama
        self.llama_ctx = _llama_ctx(prompt_ids, settings.max_new_tokens,
                                    max(int_ks(settings.ks) + settings.llama_draft_max + [LOOKUP_DEFAULT_TOKENS]))
        self.skipped = self._unavailable(draft)
        methods = [m for m in settings.methods if m not in self.skipped]
        if not methods:
            raise ValueError("no method left to run: " + "; ".join(f"{m}: {why}" for m, why in self.skipped.items()
                                                                     if m in settings.methods))
        self.methods = tuple(m for m in METHODS if m in methods)  # canonical order
        self.plain = AutoregressiveGenerator(target)
        # One generator per K: a generator's K (a number, or "auto" and its policy) is set when it is built.
        self.spec = {k: SpeculativeGenerator(target, draft, num_speculative_tokens=k, method=settings.method)
                     for k in settings.ks} if draft is not None else {}
        self.tokenizer = self.plain.tokenizer
        self.lookup = _is_lookup(draft)
        self.llama_peers = None
        if any(m in self.methods for m in ("llamacpp-plain", "llamacpp-prompt-lookup")):
            self.llama_peers = LlamaCppPeers(Path(llama.target_gguf), llama.threads, self.llama_ctx)
        self.llama_binary = SpeculativeBinary.find(llama.speculative_binary) \
            if "llama-speculative" in self.methods else None

    def _unavailable(self, draft) -> dict[str, str]:
        """Methods that cannot run here, and why."""
        import importlib.util

        skipped = {}
        if draft is None:
            skipped.update({m: "no draft (--draft none)" for m in ("specdecode", "hf-assisted", "llama-speculative")})
        if self.hf_target is None:
            skipped.update({m: "transformers' generate() needs a transformers target" for m in ("hf-plain",
                                                                                                 "hf-assisted")})
        elif draft is not None and self.hf_draft is None and not _is_lookup(draft):
            skipped["hf-assisted"] = "transformers' assisted generation needs a transformers draft"
        if self.settings.batch_size > 1:
            skipped.setdefault("hf-assisted", "transformers' assisted generation takes one row at a time "
                                              "(--batch-size 1)")
        setup = self.llama_setup
        if setup is None or setup.target_gguf is None:
            skipped.update({m: "llama.cpp's methods need a GGUF target (a built-in model or a .gguf file)"
                            for m in LLAMACPP})
        elif importlib.util.find_spec("llama_cpp") is None:
            from ..backends.llamacpp import INSTALL_HINT

            skipped.update({m: INSTALL_HINT for m in ("llamacpp-plain", "llamacpp-prompt-lookup")})
        if setup is not None and "llama-speculative" not in skipped:
            if not setup.speculative_binary:
                skipped["llama-speculative"] = "give the binary: --llama-speculative PATH"
            elif setup.draft_gguf is None:
                skipped["llama-speculative"] = "llama-speculative needs a GGUF draft (a built-in model or a .gguf file)"
        return skipped

    def _auto_max(self) -> int:
        return max((g.max_speculative_tokens for g in self.spec.values()), default=1)

    # -- planning
    def units(self, temperature: float) -> list[Unit]:
        units = [Unit(m, temperature) for m in self.methods if m not in SPECULATIVE and m != "llama-speculative"]
        if "llama-speculative" in self.methods:  # independent of our K: timed once per draft-max
            units += [Unit("llama-speculative", temperature, draft_max=n) for n in self.settings.llama_draft_max]
        for k in self.settings.ks:
            units += [Unit(m, temperature, k) for m in self.methods if m in SPECULATIVE]
        return units

    def total_steps(self) -> int:
        s = self.settings
        per_temperature = len(self.units(s.temperatures[0]))
        return len(s.temperatures) * per_temperature * (s.warmup + s.runs) + 1  # + 1: the cost measurement

    # -- running
    def _run_unit(self, unit: Unit, batches: list[list[list[int]]], seed: int) -> Record:
        s = self.settings
        args = (batches, s.max_new_tokens, unit.temperature, s.top_k, s.top_p, seed)
        if unit.method == "specdecode-plain":
            return run_ours(self.plain, *args)
        if unit.method == "specdecode":
            return run_ours(self.spec[unit.k], *args)
        if unit.method == "hf-plain":
            return run_hf(self.hf_target, self.tokenizer, *args)
        if unit.method == "llamacpp-plain":
            return run_llamacpp(self.llama_peers, *args)
        if unit.method == "llamacpp-prompt-lookup":
            return run_llamacpp(self.llama_peers, *args,
                                lookup=LOOKUP_DEFAULT_TOKENS if unit.k == AUTO else unit.k)
        if unit.method == "llama-speculative":
            return run_llama_speculative(self.llama_binary, self.llama_setup, self.tokenizer, *args,
                                         draft_max=unit.draft_max, n_ctx=self.llama_ctx)
        if self.lookup:  # prompt lookup: transformers has it too, with a fixed number of tokens
            k = self._auto_max() if unit.k == AUTO else unit.k
            return run_hf(self.hf_target, self.tokenizer, *args, prompt_lookup=k)
        return run_hf(self.hf_target, self.tokenizer, *args, assistant=self.hf_draft, k=unit.k)

    def run(self, progress: Callable[[str], None] | None = None) -> dict:
        s = self.settings
        progress = progress or (lambda _label: None)
        started = time.time()
        costs = measure_costs(next(iter(self.spec.values()), self.plain), self.prompt_ids[0],
                              cost_ks(s.ks, self._auto_max()), s.cost_repeats)
        progress("step costs")
        records: dict[Unit, list[Record]] = {}
        for temperature in s.temperatures:
            units = self.units(temperature)
            for w in range(s.warmup):  # untimed: first batch only
                for unit in units:
                    self._run_unit(unit, self.batches[:1], s.seed + 10_000 * (w + 1))
                    progress(f"warm-up {unit.label}")
            for r in range(s.runs):
                for unit in units:  # interleaved: A B C D, A B C D, ...
                    seed = s.seed + 1_000_003 * (r + 1)  # the same seeds for every method in a round
                    records.setdefault(unit, []).append(self._run_unit(unit, self.batches, seed))
                    progress(f"run {r + 1}/{s.runs} {unit.label}")
        return self._report(records, costs, time.time() - started)

    # -- reporting
    def _block(self, unit: Unit, recs: list[Record]) -> dict:
        tps = [r.tokens_per_second for r in recs]
        mspt = [r.ms_per_token for r in recs]
        t, m = st.summarize(tps), st.summarize(mspt)
        per_prompt = recs[0].per_prompt_tokens
        block = {
            "tokens_per_second": t["median"], "tokens_per_second_mean": t["mean"], "tokens_per_second_std": t["std"],
            "tokens_per_second_min": t["min"], "tokens_per_second_max": t["max"],
            "ms_per_token": m["median"], "ms_per_token_mean": m["mean"], "ms_per_token_std": m["std"],
            "tokens_per_second_runs": tps, "ms_per_token_runs": mspt,
            "runs": [{"tokens": r.tokens, "seconds": r.seconds, "tokens_per_second": r.tokens_per_second,
                      "ms_per_token": r.ms_per_token, "per_prompt_tokens": r.per_prompt_tokens,
                      "per_prompt_seconds": r.per_prompt_seconds} for r in recs],
            "new_tokens_per_prompt": per_prompt,
            "lengths_match": all(n == self.settings.max_new_tokens for r in recs for n in r.per_prompt_tokens),
            "k": unit.k, "temperature": unit.temperature, "batch_size": self.settings.batch_size,
        }
        if unit.method in LLAMACPP:
            block["rows"] = "one after another (llama.cpp's generation takes one prompt at a time)"
        if unit.method == "llama-speculative":
            block.update(self._speculative_binary_block(unit, recs))
        if unit.method in ("specdecode", "specdecode-plain"):
            merged = merge_stats([r.stats for r in recs])
            block["stats"] = merged.to_dict()
            block["decode_tokens_per_second"] = st.summarize([r.stats.decode_tokens_per_second for r in recs])["median"]
            if unit.method == "specdecode":
                pos = merged.per_position_acceptance
                block.update(acceptance_rate=merged.acceptance_rate, mean_accepted_length=merged.mean_accepted_length,
                             per_position_acceptance=pos, alpha=pos[0] if pos else 0.0,
                             target_forward_calls=merged.target_forward_calls,
                             draft_forward_calls=merged.draft_forward_calls)
        if unit.method == "hf-assisted":
            tokens = sum(r.tokens for r in recs)
            target_calls = sum(r.target_calls for r in recs)
            draft_calls = sum(r.draft_calls for r in recs)
            block.update(
                acceptance_rate=(tokens - target_calls) / draft_calls if draft_calls else 0.0,
                mean_accepted_length=tokens / target_calls if target_calls else 0.0,
                target_forward_calls=target_calls, draft_forward_calls=draft_calls,
                counting_note="from forward-call counts: accepted = tokens - target calls, proposed = draft calls; "
                              "tokens per target call includes the first (prefill + verify) call")
        if unit.method not in SPECULATIVE:
            block["shared_across_k"] = True
        return block

    def _speculative_binary_block(self, unit: Unit, recs: list[Record]) -> dict:
        drafted = [r.extra["n_drafted"] for r in recs if r.extra.get("n_drafted") is not None]
        accepted = [r.extra["n_accept"] for r in recs if r.extra.get("n_accept") is not None]
        rates = [x for r in recs for x in r.extra["decode_tokens_per_second"]]
        return {
            "draft_max": unit.draft_max, "command": recs[-1].extra["command"],
            # the binary stops after the step that passes -n, so it may make a few tokens more; all are counted
            "lengths_match": all(n >= self.settings.max_new_tokens for r in recs for n in r.per_prompt_tokens),
            "lengths_note": "llama-speculative stops after the step that passes -n: it may make a few more tokens",
            "acceptance_rate": sum(accepted) / sum(drafted) if drafted and sum(drafted) else None,
            "n_drafted": sum(drafted) if drafted else None, "n_accept": sum(accepted) if accepted else None,
            "decode_tokens_per_second": st.summarize(rates)["median"] if rates else None,
            "prompt_tokens_llama": recs[-1].extra["prompt_tokens"],
            "throughput_note": "(prompt evaluation + decoding seconds it prints) per run; model loading left out",
        }

    def _config(self, temperature: float, k, records: dict, costs: dict) -> dict:
        methods = {}
        for unit in sorted(self.units(temperature), key=lambda u: (METHODS.index(u.method), u.draft_max or 0)):
            if unit.k in (None, k):
                methods[unit.name] = self._block(unit, records[unit])
        for name, block in methods.items():
            block["speedup_vs"] = {other: (block["tokens_per_second"] / b["tokens_per_second"]
                                           if b["tokens_per_second"] else None)
                                   for other, b in methods.items() if other != name}
        theory = None
        spec = methods.get("specdecode")
        if spec is not None and k == AUTO:  # the K the engine chose, step by step
            spec.update(mean_k=spec["stats"].get("mean_k"), k_histogram=spec["stats"].get("k_histogram"),
                        plain_steps=spec["stats"].get("plain_steps"))
        elif spec is not None and costs.get("c") is not None:  # the formulas hold for a fixed K
            alpha, c, v = spec["alpha"], costs["c"], costs["v"][str(k)]
            plain = methods.get("specdecode-plain")
            theory = {
                "alpha": alpha, "alpha_note": "acceptance of the first draft of each step (Leviathan's α = E[β])",
                "c": c, "v": v,
                "expected_tokens_per_step": st.expected_tokens_per_step(alpha, k),
                "measured_tokens_per_step": spec["mean_accepted_length"],
                "expected_speedup": st.expected_speedup(alpha, k, c),
                "expected_speedup_refined": st.expected_speedup(alpha, k, c, v),
                "measured_speedup": (spec["tokens_per_second"] / plain["tokens_per_second"]
                                     if plain and plain["tokens_per_second"] else None),
            }
            spec["expected_speedup"] = theory["expected_speedup"]
            spec["expected_speedup_refined"] = theory["expected_speedup_refined"]
        return {"k": k, "temperature": temperature, "methods": methods, "theory": theory}

    def _report(self, records: dict, costs: dict, elapsed: float) -> dict:
        s = self.settings
        sweep = [self._config(t, k, records, costs) for t in s.temperatures for k in s.ks]
        by_temperature = []
        for t in s.temperatures:
            configs = [c for c in sweep if c["temperature"] == t]
            scored = [c for c in configs if "specdecode" in c["methods"]] or \
                     [c for c in configs if "hf-assisted" in c["methods"]]
            if scored:
                name = "specdecode" if "specdecode" in scored[0]["methods"] else "hf-assisted"
                best = max(scored, key=lambda c: c["methods"][name]["tokens_per_second"])
                plain = best["methods"].get(PLAIN_OF[name])
                speedup = (best["methods"][name]["tokens_per_second"] / plain["tokens_per_second"]
                           if plain and plain["tokens_per_second"] else None)
                by_temperature.append({"temperature": t, "k": best["k"], "method": name,
                                       "tokens_per_second": best["methods"][name]["tokens_per_second"],
                                       "speedup_vs_plain": speedup,
                                       "speculation_pays": speedup is None or speedup > 1.0})
            else:
                by_temperature.append({"temperature": t, "k": None, "method": None, "tokens_per_second": None,
                                       "speedup_vs_plain": None, "speculation_pays": None})
        first = by_temperature[0]
        top = next((c for c in sweep if c["temperature"] == first["temperature"] and
                    (first["k"] is None or c["k"] == first["k"])), sweep[0])
        return {
            "schema": SCHEMA,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "elapsed_s": elapsed,
            "environment": environment(self.plain),
            "config": {**self.info, "ks": list(s.ks), "temperatures": list(s.temperatures),
                       "max_new_tokens": s.max_new_tokens, "runs": s.runs, "warmup": s.warmup, "top_k": s.top_k,
                       "top_p": s.top_p, "methods": list(self.methods), "seed": s.seed, "sampler": s.method,
                       "num_prompts": len(self.prompt_ids), "batch_size": s.batch_size,
                       "rows_per_run": sum(len(b) for b in self.batches),
                       "prompt_tokens": [len(p) for p in self.prompt_ids],
                       "throughput": "end to end: new tokens / wall time of the generate() calls, prefill included",
                       "lengths": "ours: ignore_eos=True; transformers: min_new_tokens = max_new_tokens",
                       "skipped": {m: why for m, why in self.skipped.items() if m in s.methods},
                       "llamacpp": self._llama_config()},
            "costs": costs,
            "sweep": sweep,
            "recommended": {"k": first["k"], "temperature": first["temperature"], "by_temperature": by_temperature},
            "k": top["k"], "temperature": top["temperature"],
            "methods": top["methods"],
            "theory": top["theory"],
        }


    def _llama_config(self) -> dict | None:
        setup = self.llama_setup
        if setup is None or not any(m in self.methods for m in LLAMACPP):
            return None
        binary = self.llama_binary
        return {"target_gguf": setup.target_gguf, "draft_gguf": setup.draft_gguf, "threads": setup.threads,
                "n_ctx": self.llama_ctx, "flash_attn": True, "speculative_binary": binary.path if binary else None,
                "draft_max": list(self.settings.llama_draft_max) if binary else None,
                "prompt_lookup_tokens": f"K; {LOOKUP_DEFAULT_TOKENS} (its default) for K=auto",
                "sampling_note": "min-p 0, typical-p 1, repeat penalty 1; llama.cpp applies top-p before the "
                                 "temperature (ours after): the same distribution when top-p = 1 or T = 1"}

    def close(self) -> None:
        """Free llama-cpp-python's models (our models belong to the caller)."""
        if self.llama_peers is not None:
            self.llama_peers.close()


def _is_lookup(drafter) -> bool:
    from ..drafters import PromptLookupDrafter

    return isinstance(drafter, PromptLookupDrafter)


def environment(generator=None) -> dict:
    """Versions, machine, and where the generator's target runs (its backend, device, and dtype when known)."""
    import transformers

    from .. import __version__

    env = {"specdecode": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads()}
    if generator is not None:
        device = generator.target.device
        env.update(backend=type(generator.target).__name__, device=str(device))
        parameters = getattr(generator.target_model, "parameters", None)
        param = next(parameters(), None) if callable(parameters) else None
        if param is not None:
            env["dtype"] = str(param.dtype).replace("torch.", "")
        if device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(device)
    return env


# ----------------------------------------------------------------------------------------------- latency
def measure_latency(target, draft, prompt_ids: list[int], ks: list, max_new_tokens: int = 32, runs: int = 3,
                    temperature: float = 0.0, seed: int = 0, repeats: int = 3, method: str = "leviathan",
                    progress: Callable[[str], None] | None = None) -> dict:
    """ms/token of the target alone and with the draft: forward costs, then end-to-end decoding of one prompt.

    target, draft: what the generators accept; ks: numbers of draft tokens per step, or "auto".
    """
    progress = progress or (lambda _label: None)
    plain = AutoregressiveGenerator(target)
    spec = {k: SpeculativeGenerator(target, draft, num_speculative_tokens=k, method=method) for k in ks} \
        if draft is not None else {}
    auto_max = max((g.max_speculative_tokens for g in spec.values()), default=1)
    costs = measure_costs(next(iter(spec.values()), plain), prompt_ids, cost_ks(ks, auto_max) if spec else [],
                          repeats)
    progress("step costs")
    units = [("plain", None)] + [("speculative", k) for k in spec]
    generators = {("plain", None): plain, **{("speculative", k): g for k, g in spec.items()}}
    for unit in units:  # warm-up
        run_ours(generators[unit], [[prompt_ids]], min(8, max_new_tokens), temperature, 0, 1.0, seed)
    progress("warm-up")
    records: dict = {}
    for r in range(runs):
        for unit in units:
            records.setdefault(unit, []).append(run_ours(generators[unit], [[prompt_ids]], max_new_tokens,
                                                         temperature, 0, 1.0, seed + r))
            progress(f"run {r + 1}/{runs} {unit[0]}" + (f" K={unit[1]}" if unit[1] else ""))
    plain_ms, plain_decode = _latency(records[("plain", None)])
    result = {"schema": "specdecode.latency/1", "environment": environment(plain), "costs": costs,
              "max_new_tokens": max_new_tokens, "runs": runs, "temperature": temperature,
              "prompt_tokens": len(prompt_ids),
              "target_alone": {"step_ms": costs["target_step_ms"], "ms_per_token": plain_ms["median"],
                               "ms_per_token_std": plain_ms["std"], "decode_ms_per_token": plain_decode["median"]},
              "with_draft": []}
    for unit in units[1:]:
        ms, decode = _latency(records[unit])
        merged = merge_stats([x.stats for x in records[unit]])
        result["with_draft"].append({
            "k": unit[1], "ms_per_token": ms["median"], "ms_per_token_std": ms["std"],
            "decode_ms_per_token": decode["median"], "draft_step_ms": costs["draft_step_ms"],
            "verify_ms": costs["verify_ms"].get(str(unit[1])), "acceptance_rate": merged.acceptance_rate,
            "mean_accepted_length": merged.mean_accepted_length, "mean_k": getattr(merged, "mean_k", None),
            "speedup": plain_ms["median"] / ms["median"] if ms["median"] else None})
    return result


def _latency(records: list[Record]) -> tuple[dict, dict]:
    """Summaries of ms/token end to end, and after the prefill."""
    return (st.summarize([x.ms_per_token for x in records]),
            st.summarize([1000.0 / x.stats.decode_tokens_per_second for x in records
                          if x.stats.decode_tokens_per_second > 0]))
