"""`specdecode bench`: our loop against its peers (transformers, llama.cpp), in one process, on the same prompts
and settings.

The methods are in bench/methods/, one class each, listed in one table (its docstring says how to add one).
All decode the same target, one prompt at a time unless --batch-size, the same number of new tokens per prompt.
The llama.cpp methods need a GGUF target (a built-in model or a .gguf file), whatever backend ours run on.

Batches (--batch-size N): every generate() call gets N rows (consecutive prompts, the set cycled to fill the last
batch); ours and hf-plain decode them together (tokens/s summed over rows), llama.cpp's methods one after another,
and transformers' assisted generation, which takes one row, is left out.

Our methods go through the engine and the ModelBackend interface only (the step costs too), so they run on any
backend; transformers' methods need transformers models and are left out (with a note) for other backends.

Lengths: our engine runs with ignore_eos=True; transformers with min_new_tokens = max_new_tokens, so every method
emits exactly max_new_tokens tokens per prompt (checked, and reported in `lengths_match`).

Prompts with JSON schemas (the json set, or a .jsonl file with "schema"): only the methods that decode under a
schema run (ours and llama-cpp-python's grammar); each output stops at the end of its JSON value, and the report
gives each method's validity rate (bench/validity.py) and, for ours, the tokens forced by the grammar.

Multi-turn sessions (--prompts multi-turn, bench/sessions.py): the prompts are every turn of every session, in
order, built beforehand from ours plain's greedy answers; each method decodes them one at a time, greedy, each
answer stopped at its end of generation; the report adds a table per turn (bench/turns_report.py). A suffix
drafter's history is emptied before every run (methods/specdecode.py), so it holds only what a server would have
seen before each turn. specdecode-prompt-lookup and specdecode-suffix (methods/specdecode_copy.py) bring their own
drafter, so one run compares --draft (a model or suffix+MODEL) with both copying drafts and llama.cpp's peers.

Runs are interleaved (A B C D A B C D ...) after a warm-up (bench/interleave.py), so drift of a shared machine hits
every method alike. Throughput is end to end (prefill included, as in a user's call): new tokens / wall time of
the generate() calls. The report is assembled in bench/report.py.
"""

from __future__ import annotations

import time
from typing import Callable

from ..engine.generators import AutoregressiveGenerator, SpeculativeGenerator
from .costs import cost_ks, measure_costs
from .interleave import interleave
from .llamacpp_peers import LOOKUP_DEFAULT_TOKENS
from .methods import METHOD_CLASSES, BenchContext, BenchMethod
from .methods.base import LlamaPeerSetup
from .methods.hf import transformers_model
from .peers import llama_context, model_part
from .report import bench_report
from .sessions import TurnPlan
from .settings import BenchSettings
from .units import Unit, int_ks
from .workload import make_batches

# Where bench.advise, scripts and tests have found these (the modules above are their homes).
from .environment import environment  # noqa: F401
from .latency import measure_latency  # noqa: F401
from .methods.specdecode_plain import run_ours  # noqa: F401
from .units import Measurement as Record  # noqa: F401
from .workload import encode_prompts  # noqa: F401


class Bench:
    """Holds the generators and the models the peers run on; `run()` produces the report (a JSON-ready dict).
    target and draft: what the generators accept (what load_model returns, a transformers model, a ModelBackend;
    the draft may also be a Drafter)."""

    def __init__(self, target, draft, prompt_ids: list[list[int]], settings: BenchSettings,
                 info: dict | None = None, peer_target=None, peer_draft=None, llama: LlamaPeerSetup | None = None,
                 schemas: list[dict] | None = None, turns: TurnPlan | None = None, cost_prior=None):
        """peer_target / peer_draft: the models transformers' methods run on, when they differ from ours (a
        transformers user loads plain fp32 models, without our prepacking or draft quantization). llama: the
        GGUF files, threads and binary llama.cpp's methods run on (None: they are left out). schemas: each
        prompt's JSON schema (None: free text). turns: the multi-turn workload whose turns prompt_ids are.
        cost_prior: what the speculative generators' policies start from (what `generate` passes: the CLI's
        pairing.pair.recorded_cost_prior); given, it is kept for good (fixed costs), as `generate` keeps it on a CPU."""
        from ..drafters import PromptLookupDrafter

        settings.check()
        if turns is not None:
            turns.check(prompt_ids, settings)
        self.turns = turns
        self.prompt_ids = prompt_ids
        self.batches = make_batches(prompt_ids, settings.batch_size)
        if schemas is not None and len(schemas) != len(prompt_ids):
            raise ValueError(f"{len(schemas)} schemas for {len(prompt_ids)} prompts: give one per prompt")
        self.schema_batches = make_batches(schemas, settings.batch_size) if schemas is not None else None
        self.settings = settings
        self.info = dict(info or {})
        plain = AutoregressiveGenerator(target)
        # One generator per K: a generator's K (a number, or "auto" and its policy) is set when it is built.
        spec = {k: SpeculativeGenerator(target, draft, num_speculative_tokens=k, method=settings.method,
                                        cost_prior=cost_prior, fixed_costs=cost_prior is not None)
                for k in settings.ks} if draft is not None else {}
        extra = max(int_ks(settings.ks) + settings.llama_draft_max + [LOOKUP_DEFAULT_TOKENS])
        self.ctx = BenchContext(
            settings, prompt_ids, plain, spec, has_draft=draft is not None,
            lookup=isinstance(draft, PromptLookupDrafter), hf_target=transformers_model(peer_target or target),
            hf_draft=transformers_model(peer_draft or model_part(draft)) if draft is not None else None, llama=llama,
            llama_ctx=llama_context(prompt_ids, settings.max_new_tokens, extra), schemas=schemas, target=target,
            turns=turns)
        # the methods asked for that cannot run here, and why
        self.skipped = {name: why for name, cls in METHOD_CLASSES.items()
                        if name in settings.methods and (why := cls.left_out(self.ctx))}
        chosen = [m for m in METHOD_CLASSES if m in settings.methods and m not in self.skipped]  # canonical order
        if not chosen:
            raise ValueError("no method left to run: " + "; ".join(f"{m}: {why}" for m, why in self.skipped.items()))
        self.methods = tuple(chosen)
        self.runners: dict[str, BenchMethod] = {}
        try:
            for name in chosen:
                self.runners[name] = METHOD_CLASSES[name](self.ctx)
        except BaseException:
            self.close()
            raise

    @property
    def row_schemas(self) -> list[dict] | None:
        """The JSON schema of every row of a run, in the order of the batches (None: free text)."""
        return [s for batch in self.schema_batches for s in batch] if self.schema_batches is not None else None

    # -- planning
    def units(self, temperature: float) -> list[Unit]:
        """What is timed at a temperature: the methods shared by every K, then each K's speculative methods."""
        units = [u for m in self.runners.values() if not m.per_k for u in m.units(temperature)]
        for k in self.settings.ks:
            units += [Unit(m.name, temperature, k) for m in self.runners.values() if m.per_k]
        return units

    def total_steps(self) -> int:
        s = self.settings
        per_temperature = len(self.units(s.temperatures[0]))
        return len(s.temperatures) * per_temperature * (s.warmup + s.runs) + 1  # + 1: the cost measurement

    # -- running
    def _run_unit(self, unit: Unit, seed: int, first: int | None = None):
        """Run a unit on the first `first` batches (all when None)."""
        schemas = self.schema_batches[:first] if self.schema_batches is not None else None
        return self.runners[unit.method].run(unit, self.batches[:first], seed, schemas)

    def run(self, progress: Callable[[str], None] | None = None) -> dict:
        s = self.settings
        progress = progress or (lambda _label: None)
        started = time.time()
        costs = measure_costs(next(iter(self.ctx.spec.values()), self.ctx.plain), self.prompt_ids[0],
                              cost_ks(s.ks, self.ctx.auto_max), s.cost_repeats)
        progress("step costs")
        measured = {}
        for temperature in s.temperatures:
            measured.update(interleave(
                self.units(temperature),
                warm=lambda unit, w: self._run_unit(unit, s.seed + 10_000 * (w + 1), first=1),
                # the same seeds for every method in a round
                timed=lambda unit, r: self._run_unit(unit, s.seed + 1_000_003 * (r + 1)),
                warmups=s.warmup, rounds=s.runs, progress=progress, label=lambda unit: unit.label))
        return bench_report(self, measured, costs, time.time() - started)

    def close(self) -> None:
        """Free what the peers loaded (our models belong to the caller)."""
        for runner in self.runners.values():
            runner.close()
        self.ctx.close()
