"""What every bench method is, and what they all run on.

A method is one class: its name in --methods and in the report, whether it can run here (`unavailable`), how it
decodes the bench's batches (`run`, one Measurement per call) and what it adds to its report block (`report`).
The runner, the interleave loop and the report know methods only through this interface. A method's module
imports its libraries (torch, numpy, transformers, llama_cpp) inside its functions: the table of methods is
cheap to import, and the CLI lists it in its help.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from ..units import Measurement, Unit

OURS, TRANSFORMERS, LLAMACPP = "ours", "transformers", "llama.cpp"  # what a method's runs_on may be
NO_DRAFT = "no draft (--draft none)"  # why a method that needs a draft is left out
NOT_MULTI_TURN = ("makes exactly max_new_tokens tokens, past the end of generation: the multi-turn workload stops "
                  "each answer there")


@dataclass
class LlamaPeerSetup:
    """What llama.cpp's methods run on: the GGUF files of our target and draft (None when a model is not a GGUF),
    what the draft's file is in words (draft_gguf_is: ours, or its lean copy ours drafts on), the threads, and the
    llama-speculative binary (None: that method is not run)."""

    target_gguf: str | None
    draft_gguf: str | None = None
    draft_gguf_is: str | None = None
    threads: int | None = None
    speculative_binary: str | None = None


@dataclass
class BenchContext:
    """What the methods run on, built once per bench.

    plain / spec: our generators (spec: one per K of the settings; empty without a draft). hf_target / hf_draft:
    the transformers models transformers' methods run on (None when not transformers models). llama: the GGUF
    files, threads and binary of llama.cpp's methods (None: they are left out); llama_ctx: the context of every
    llama.cpp model, large enough for any prompt, its new tokens and a step of drafts. target: the target as the
    caller loaded it (the generators of the methods that bring their own drafter). turns: the multi-turn workload
    (bench/sessions.py; None: every prompt stands alone).
    """

    settings: object  # a bench.settings.BenchSettings (above the methods: its defaults name them)
    prompt_ids: list[list[int]]
    plain: object
    spec: dict
    has_draft: bool
    lookup: bool  # the draft is prompt lookup (no draft model)
    hf_target: object = None
    hf_draft: object = None
    llama: LlamaPeerSetup | None = None
    llama_ctx: int = 0
    llama_binary: object = None  # the llama-speculative binary, found by that method when it runs
    schemas: list[dict] | None = None  # each prompt's JSON schema (the json workload); None: free text
    target: object = None
    turns: object = None  # a bench.sessions.TurnPlan (above the methods: built by ours plain); None: none
    _llama_peers: object = field(default=None, repr=False)

    @property
    def tokenizer(self):
        return self.plain.tokenizer

    @property
    def until_eos(self) -> bool | None:
        """Every answer stops at its end-of-generation token (the multi-turn workload); None: the method's own
        rule (exactly max_new_tokens, or the end of the JSON value)."""
        return True if self.turns is not None else None

    @property
    def stop_ids(self) -> set[int] | None:
        """The tokens that end an answer when until_eos: our generator's, so every method stops alike."""
        return set(self.plain.eos_token_ids) if self.turns is not None else None

    @property
    def auto_max(self) -> int:
        """The most drafts the engine's "auto" policy may choose."""
        return max((g.max_speculative_tokens for g in self.spec.values()), default=1)

    def llama_peers(self):
        """llama-cpp-python's models on the target's GGUF file (bench.llamacpp_peers), shared by its methods."""
        if self._llama_peers is None:
            from pathlib import Path

            from ..llamacpp_peers import LlamaCppPeers

            self._llama_peers = LlamaCppPeers(Path(self.llama.target_gguf), self.llama.threads, self.llama_ctx)
        return self._llama_peers

    def close(self) -> None:
        """Free llama-cpp-python's models (our models belong to the caller)."""
        if self._llama_peers is not None:
            self._llama_peers.close()
            self._llama_peers = None


class BenchMethod(ABC):
    """One decoding method of the bench.

    Class attributes: name (in --methods and the report); per_k: timed once per K of the sweep (a speculative
    method whose K is ours to set), else once per temperature and shared by every K; plain: the same library's
    plain decoding, the baseline of this method's speedup; recommends: its best K is the bench's recommendation
    (the first such method that ran); default: in --methods unless the user names the methods; runs_on: the models
    it decodes with: ours (any backend), transformers' (our target, or stock copies of it: --peer-models) or
    llama.cpp's (the target's GGUF file; the report then describes llama.cpp's setup); structured: it decodes
    under each prompt's JSON schema (a workload with schemas runs only such methods); structured_only: it runs
    only on such a workload; on_request: left out of a Bench whose settings do not name it (BenchSettings' default
    methods are the others); stops_at_eos: it can stop each answer at its end-of-generation token, so it runs on
    the multi-turn workload (and is one of that workload's default methods).
    """

    name: ClassVar[str]
    per_k: ClassVar[bool] = False
    plain: ClassVar[str | None] = None
    recommends: ClassVar[bool] = False
    default: ClassVar[bool] = True
    runs_on: ClassVar[str] = OURS
    structured: ClassVar[bool] = False
    structured_only: ClassVar[bool] = False
    on_request: ClassVar[bool] = False
    stops_at_eos: ClassVar[bool] = False

    def __init__(self, ctx: BenchContext):
        self.ctx = ctx

    @classmethod
    def unavailable(cls, ctx: BenchContext) -> str | None:
        """Why this method cannot run here, or None when it can."""
        return None

    @classmethod
    def left_out(cls, ctx: BenchContext) -> str | None:
        """Why this method is not run on this workload or here, or None when it runs."""
        if ctx.schemas is not None and not cls.structured:
            return "does not constrain its output to a JSON schema (the workload has schemas)"
        if ctx.schemas is None and cls.structured_only:
            return "runs only on a workload with JSON schemas (--prompts json)"
        if ctx.turns is not None and not cls.stops_at_eos:
            return NOT_MULTI_TURN
        return cls.unavailable(ctx)

    def units(self, temperature: float) -> list[Unit]:
        """What a method shared by every K times at a temperature (a per-K method is timed once per K)."""
        return [Unit(self.name, temperature)]

    @abstractmethod
    def run(self, unit: Unit, batches: list[list[list[int]]], seed: int,
            schemas: list[list[dict]] | None = None) -> Measurement:
        """Decode every batch (a generate() call each) with the unit's settings; rows of a batch draw from seed.
        schemas: each batch's rows' JSON schemas (only a structured method is given them)."""

    def report(self, unit: Unit, runs: list[Measurement]) -> dict:
        """What this method adds to its block of the report, beyond throughput and lengths."""
        return {}

    def theory(self, k, blocks: dict, costs: dict) -> dict | None:
        """The sweep configuration's expected speedup next to the measured one (None: this method has none)."""
        return None

    def close(self) -> None:
        """Free what the method loaded for itself."""

    def sampling(self, unit: Unit) -> dict:
        """The settings every method decodes a unit with."""
        s = self.ctx.settings
        return {"max_new_tokens": s.max_new_tokens, "temperature": unit.temperature, "top_k": s.top_k,
                "top_p": s.top_p}
