"""`specdecode bench`: our loop against transformers, in one process, on the same prompts and settings.

Methods (all decode the same target, one prompt at a time, the same number of new tokens per prompt):
- specdecode-plain: our decoding loop without a draft (AutoregressiveGenerator),
- specdecode:       our speculative decoding (SpeculativeGenerator) with the draft and K,
- hf-plain:         transformers `generate()` (greedy or sampling, DynamicCache),
- hf-assisted:      transformers assisted generation with the SAME draft object and the same K, constant schedule
                    and the confidence-threshold early stop disabled, so it drafts exactly K tokens per step.

Lengths: our engine runs with ignore_eos=True; transformers with min_new_tokens = max_new_tokens, so every method
emits exactly max_new_tokens tokens per prompt (checked, and reported in `lengths_match`).

Runs are interleaved (A B C D A B C D ...) after a warm-up, so drift of a shared machine hits every method alike.
Throughput is end to end (prefill included, as in a user's call): new tokens / wall time of the generate() calls.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import time
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from ..backends.hf import HFBackend
from ..engine import AutoregressiveGenerator, SpeculativeGenerator
from ..results import Stats
from . import stats as st

METHODS = ("specdecode-plain", "specdecode", "hf-plain", "hf-assisted")
SPECULATIVE = ("specdecode", "hf-assisted")
PLAIN_OF = {"specdecode": "specdecode-plain", "hf-assisted": "hf-plain"}
SCHEMA = "specdecode.bench/1"


@dataclass
class BenchSettings:
    ks: list[int] = field(default_factory=lambda: [4])
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

    def check(self) -> None:
        if not self.ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.ks):
            raise ValueError(f"K values must be integers >= 1, got {self.ks}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        if self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        if self.runs < 1:
            raise ValueError("--runs must be >= 1")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown}: choose among {', '.join(METHODS)}")


@dataclass
class Record:
    """One run of one method over all prompts."""

    tokens: int
    seconds: float
    per_prompt_tokens: list[int]
    per_prompt_seconds: list[float]
    stats: Stats | None = None  # ours: merged over the prompts
    target_calls: int = 0  # hf-assisted: forward calls counted with hooks
    draft_calls: int = 0

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
        if chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        if not ids:
            raise ValueError("a prompt encodes to no tokens")
        encoded.append(list(ids))
    return encoded


def merge_stats(items: list[Stats]) -> Stats:
    """Sum the counters and timings of several generate() calls."""
    total = Stats()
    for s in items:
        for f in fields(Stats):
            a, b = getattr(total, f.name), getattr(s, f.name)
            if isinstance(b, list):
                if len(a) < len(b):
                    a = a + [0] * (len(b) - len(a))
                setattr(total, f.name, [x + (b[i] if i < len(b) else 0) for i, x in enumerate(a)])
            elif f.name == "num_speculative_tokens":
                total.num_speculative_tokens = max(a, b)
            else:
                setattr(total, f.name, a + b)
    return total


# ----------------------------------------------------------------------------------------------- step costs
def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return st.summarize(times)["median"]


def measure_costs(target_model, draft_model, vocab_size: int, prompt_ids: list[int], ks: list[int],
                  repeats: int = 3) -> dict:
    """Forward costs on a warm cache (the prompt prefilled), measured with the backends the engine uses.

    target_step_ms: a 1-token target forward; verify_ms[K]: a (K+1)-token target forward; draft_step_ms: a
    1-token draft forward. c = draft step / target step; v[K] = verify / target step. Each is the median of
    `repeats` forwards after one untimed warm-up, with the cache trimmed back after every forward.
    """
    repeats = max(1, repeats)
    device = next(target_model.parameters()).device
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)

    def backend_timer(model):
        backend = HFBackend(model, vocab_size)
        backend.reset(1)
        backend.forward(prompt, last_only=True)
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

    target_step = backend_timer(target_model)
    t1 = target_step(1)
    verify = {k: target_step(k + 1) for k in sorted(set(ks))}
    result = {"repeats": repeats, "prompt_tokens": len(prompt_ids), "target_step_ms": 1000 * t1,
              "verify_ms": {str(k): 1000 * t for k, t in verify.items()},
              "v": {str(k): t / t1 for k, t in verify.items()}, "draft_step_ms": None, "c": None}
    if draft_model is not None:
        d1 = backend_timer(draft_model)(1)
        result.update(draft_step_ms=1000 * d1, c=d1 / t1)
    return result


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
def assistant_settings(draft_model, k: int):
    """Make transformers' assisted generation draft exactly k tokens per step, then restore the draft's config.

    num_assistant_tokens = k with the "constant" schedule (the "heuristic" default changes K as it goes), and
    assistant_confidence_threshold = 0 (its default 0.4 stops drafting early when the draft is unsure).
    """
    config = draft_model.generation_config
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    saved = {n: getattr(config, n, None) for n in names}
    config.num_assistant_tokens = k
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
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


def _draft_model(draft):
    """The draft's transformers model; None without a draft or for a model-free drafter (prompt lookup)."""
    return getattr(draft, "model", None)


def run_hf(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float, top_k: int,
           top_p: float, seed: int, assistant=None, k: int | None = None, prompt_lookup: int | None = None) -> Record:
    from transformers import DynamicCache

    device = next(model.parameters()).device
    config = _hf_generation_config(model, tokenizer, max_new_tokens, temperature, top_k, top_p)
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    per_tokens, per_seconds = [], []
    target_calls, draft_calls = [0], [0]
    for i, ids in enumerate(prompt_ids):
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        kwargs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "generation_config": config,
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
        per_tokens.append(int(output.shape[1] - input_ids.shape[1]))
    return Record(sum(per_tokens), sum(per_seconds), per_tokens, per_seconds, target_calls=target_calls[0],
                  draft_calls=draft_calls[0])


def run_ours(generator, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float, top_k: int,
             top_p: float, seed: int, k: int | None = None) -> Record:
    per_tokens, per_seconds, all_stats = [], [], []
    for i, ids in enumerate(prompt_ids):
        t0 = time.perf_counter()
        result = generator.generate([ids], max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                    top_p=top_p, seed=seed + i, ignore_eos=True, num_speculative_tokens=k)
        per_seconds.append(time.perf_counter() - t0)
        per_tokens.append(len(result.token_ids[0]))
        all_stats.append(result.stats)
    return Record(sum(per_tokens), sum(per_seconds), per_tokens, per_seconds, stats=merge_stats(all_stats))


# ----------------------------------------------------------------------------------------------- the benchmark
@dataclass(frozen=True)
class Unit:
    """One thing that is timed: a method, at a temperature, with a K for the speculative ones."""

    method: str
    temperature: float
    k: int | None = None

    @property
    def label(self) -> str:
        return self.method + (f" K={self.k}" if self.k is not None else "") + f" T={self.temperature:g}"


class Bench:
    """Holds the loaded pair and the generators; `run()` produces the report (a JSON-ready dict)."""

    def __init__(self, target, draft, prompt_ids: list[list[int]], settings: BenchSettings,
                 info: dict | None = None, peer_target=None, peer_draft=None):
        """peer_target / peer_draft: the models transformers' methods run on, when they differ from ours (a
        transformers user loads plain fp32 models, without our prepacking or draft quantization)."""
        settings.check()
        self.target, self.draft = target, draft
        self.peer_target = peer_target or target
        self.peer_draft = peer_draft or draft
        self.prompt_ids = prompt_ids
        self.settings = settings
        self.info = dict(info or {})
        methods = [m for m in settings.methods if draft is not None or m not in SPECULATIVE]
        if not methods:
            raise ValueError("no method left to run: speculative methods need a draft (--draft)")
        self.methods = tuple(m for m in METHODS if m in methods)  # canonical order
        self.plain = AutoregressiveGenerator(target) if "specdecode-plain" in self.methods else None
        self.spec = (SpeculativeGenerator(target, draft, num_speculative_tokens=max(settings.ks),
                                          method=settings.method)
                     if "specdecode" in self.methods else None)
        self.vocab_size = (self.spec or self.plain or AutoregressiveGenerator(target)).target.vocab_size

    # -- planning
    def units(self, temperature: float) -> list[Unit]:
        units = [Unit(m, temperature) for m in self.methods if m not in SPECULATIVE]
        for k in self.settings.ks:
            units += [Unit(m, temperature, k) for m in self.methods if m in SPECULATIVE]
        return units

    def total_steps(self) -> int:
        s = self.settings
        per_temperature = len(self.units(s.temperatures[0]))
        return len(s.temperatures) * per_temperature * (s.warmup + s.runs) + 1  # + 1: the cost measurement

    # -- running
    def _run_unit(self, unit: Unit, prompt_ids: list[list[int]], seed: int) -> Record:
        s = self.settings
        args = (prompt_ids, s.max_new_tokens, unit.temperature, s.top_k, s.top_p, seed)
        target_model, tokenizer = self.peer_target.model, self.target.tokenizer
        if unit.method == "specdecode-plain":
            return run_ours(self.plain, *args)
        if unit.method == "specdecode":
            return run_ours(self.spec, *args, k=unit.k)
        if unit.method == "hf-plain":
            return run_hf(target_model, tokenizer, *args)
        if _draft_model(self.peer_draft) is None:  # prompt lookup: transformers has it too
            return run_hf(target_model, tokenizer, *args, prompt_lookup=unit.k)
        return run_hf(target_model, tokenizer, *args, assistant=self.peer_draft.model, k=unit.k)

    def run(self, progress: Callable[[str], None] | None = None) -> dict:
        s = self.settings
        progress = progress or (lambda _label: None)
        started = time.time()
        cost_ks = sorted(set(s.ks) | set(range(1, max(max(s.ks), 4) + 1)))
        costs = measure_costs(self.target.model, _draft_model(self.draft),
                              self.vocab_size, self.prompt_ids[0], cost_ks, s.cost_repeats)
        progress("step costs")
        records: dict[Unit, list[Record]] = {}
        for temperature in s.temperatures:
            units = self.units(temperature)
            for w in range(s.warmup):  # untimed: first prompt only
                for unit in units:
                    self._run_unit(unit, self.prompt_ids[:1], s.seed + 10_000 * (w + 1))
                    progress(f"warm-up {unit.label}")
            for r in range(s.runs):
                for unit in units:  # interleaved: A B C D, A B C D, ...
                    seed = s.seed + 1_000_003 * (r + 1)  # the same seeds for every method in a round
                    records.setdefault(unit, []).append(self._run_unit(unit, self.prompt_ids, seed))
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
            "k": unit.k, "temperature": unit.temperature,
        }
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

    def _config(self, temperature: float, k: int, records: dict, costs: dict) -> dict:
        methods = {}
        for unit in sorted(self.units(temperature), key=lambda u: METHODS.index(u.method)):
            if unit.k in (None, k):
                methods[unit.method] = self._block(unit, records[unit])
        for name, block in methods.items():
            block["speedup_vs"] = {other: (block["tokens_per_second"] / b["tokens_per_second"]
                                           if b["tokens_per_second"] else None)
                                   for other, b in methods.items() if other != name}
        theory = None
        spec = methods.get("specdecode")
        if spec is not None and costs.get("c") is not None:
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
            "environment": environment(self.target.model),
            "config": {**self.info, "ks": list(s.ks), "temperatures": list(s.temperatures),
                       "max_new_tokens": s.max_new_tokens, "runs": s.runs, "warmup": s.warmup, "top_k": s.top_k,
                       "top_p": s.top_p, "methods": list(self.methods), "seed": s.seed, "sampler": s.method,
                       "num_prompts": len(self.prompt_ids),
                       "prompt_tokens": [len(p) for p in self.prompt_ids],
                       "throughput": "end to end: new tokens / wall time of the generate() calls, prefill included",
                       "lengths": "ours: ignore_eos=True; transformers: min_new_tokens = max_new_tokens"},
            "costs": costs,
            "sweep": sweep,
            "recommended": {"k": first["k"], "temperature": first["temperature"], "by_temperature": by_temperature},
            "k": top["k"], "temperature": top["temperature"],
            "methods": top["methods"],
            "theory": top["theory"],
        }


def environment(model=None) -> dict:
    import transformers

    from .. import __version__

    env = {"specdecode": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads()}
    if model is not None:
        param = next(model.parameters())
        env.update(device=str(param.device), dtype=str(param.dtype).replace("torch.", ""))
        if param.device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(param.device)
    return env


# ----------------------------------------------------------------------------------------------- latency
def measure_latency(target, draft, prompt_ids: list[int], ks: list[int], max_new_tokens: int = 32, runs: int = 3,
                    temperature: float = 0.0, seed: int = 0, repeats: int = 3, method: str = "leviathan",
                    progress: Callable[[str], None] | None = None) -> dict:
    """ms/token of the target alone and with the draft: forward costs, then end-to-end decoding of one prompt."""
    progress = progress or (lambda _label: None)
    plain = AutoregressiveGenerator(target)
    vocab = plain.target.vocab_size
    costs = measure_costs(target.model, _draft_model(draft), vocab, prompt_ids, ks, repeats)
    progress("step costs")
    spec = SpeculativeGenerator(target, draft, num_speculative_tokens=max(ks), method=method) if draft else None
    units = [("plain", None)] + ([("speculative", k) for k in ks] if spec else [])
    records: dict = {}
    for unit in units:  # warm-up
        gen = plain if unit[0] == "plain" else spec
        run_ours(gen, [prompt_ids], min(8, max_new_tokens), temperature, 0, 1.0, seed, k=unit[1])
    progress("warm-up")
    for r in range(runs):
        for unit in units:
            gen = plain if unit[0] == "plain" else spec
            records.setdefault(unit, []).append(run_ours(gen, [prompt_ids], max_new_tokens, temperature, 0, 1.0,
                                                         seed + r, k=unit[1]))
            progress(f"run {r + 1}/{runs} {unit[0]}" + (f" K={unit[1]}" if unit[1] else ""))
    plain_ms = st.summarize([x.ms_per_token for x in records[("plain", None)]])
    plain_decode = st.summarize([1000.0 / x.stats.decode_tokens_per_second for x in records[("plain", None)]
                                 if x.stats.decode_tokens_per_second > 0])
    result = {"schema": "specdecode.latency/1", "environment": environment(target.model), "costs": costs,
              "max_new_tokens": max_new_tokens, "runs": runs, "temperature": temperature,
              "prompt_tokens": len(prompt_ids),
              "target_alone": {"step_ms": costs["target_step_ms"], "ms_per_token": plain_ms["median"],
                               "ms_per_token_std": plain_ms["std"], "decode_ms_per_token": plain_decode["median"]},
              "with_draft": []}
    for unit in units[1:]:
        recs = records[unit]
        ms = st.summarize([x.ms_per_token for x in recs])
        decode = st.summarize([1000.0 / x.stats.decode_tokens_per_second for x in recs
                               if x.stats.decode_tokens_per_second > 0])
        merged = merge_stats([x.stats for x in recs])
        result["with_draft"].append({
            "k": unit[1], "ms_per_token": ms["median"], "ms_per_token_std": ms["std"],
            "decode_ms_per_token": decode["median"], "draft_step_ms": costs["draft_step_ms"],
            "verify_ms": costs["verify_ms"][str(unit[1])], "acceptance_rate": merged.acceptance_rate,
            "mean_accepted_length": merged.mean_accepted_length,
            "speedup": plain_ms["median"] / ms["median"] if ms["median"] else None})
    return result
