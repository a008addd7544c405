"""llama.cpp's own decoding, as peers of ours in `specdecode bench`, on the same GGUF files and threads.

- llamacpp-plain:          llama-cpp-python's own generation loop (`Llama.generate`), greedy or sampled;
- llamacpp-prompt-lookup:  the same with `LlamaPromptLookupDecoding` as its draft model;
- llamacpp-json-schema:    its completion under a JSON schema (`create_completion(grammar=LlamaGrammar
                           .from_json_schema(...))`, what its `response_format` does), on the json workload;
- llama-speculative-dmaxN: llama.cpp's `llama-speculative` (or `llama-speculative-simple`) binary, run as a
                           subprocess on the target and draft GGUF files, drafting at most N tokens per step.

Throughput is measured as ours is: new tokens / wall time of the generation (prefill included). For the binary,
that is the prompt evaluation plus the decoding it times itself ("encoded ... in T1 seconds", "decoded N tokens in
T2 seconds"): its model loading is left out, as ours is.

Settings matched to our run: the same token ids (the binary gets them as text and tokenizes them itself; the count
it reports is kept), temperature (0 = greedy), top-k (0 = off in both), top-p, no min-p / typical / repetition
penalty, no stop at end of generation (the Python loop never stops on its own; the binary gets --ignore-eos, which
masks end-of-generation tokens) except on the multi-turn workload (the Python loop then stops at our
end-of-generation tokens), fresh cache for every prompt. llama-cpp-python applies top-p before the
temperature, ours after: the two sample the same distribution only when top-p = 1 or T = 1.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..models.prepare import Progress

LOOKUP_DEFAULT_TOKENS = 10  # LlamaPromptLookupDecoding's own default num_pred_tokens (used for K = auto)
LOOKUP_NGRAM = 2  # its default max_ngram_size


def gguf_file(name_or_path: str | None, progress: Progress | bool | None = None) -> Path | None:
    """The GGUF file of a model given as a .gguf path or a built-in name; None for anything else."""
    if not name_or_path:
        return None
    from ..models import catalog
    from ..models.prepare import prepare_gguf

    path = Path(os.path.expanduser(name_or_path))
    if path.exists():
        return path if path.is_file() and path.suffix == ".gguf" else None
    if not catalog.is_registered(name_or_path):
        return None
    info = catalog.get_model_info(name_or_path)
    if not info.installed and not catalog.gguf_cache_path(name_or_path).exists():
        return None
    return Path(prepare_gguf(name_or_path, progress=progress)[0])


def default_threads() -> int:
    """The threads llama.cpp uses when none are given (every core this process may use), as our backend does."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ----------------------------------------------------------------------------------------------- llama-cpp-python
class LlamaCppPeers:
    """llama-cpp-python's generation on one GGUF file: one Llama for plain decoding and one per prompt-lookup
    size (a draft model makes Llama compute the logits of every position, prompt included, so it gets its own)."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int):
        import llama_cpp  # noqa: F401  (a clear ImportError before anything is timed)

        self.gguf, self.threads, self.n_ctx = Path(gguf), threads, n_ctx
        self._llamas: dict = {}
        self._grammars: dict = {}  # JSON schema (its canonical text) -> LlamaGrammar, converted once

    def _llama(self, lookup: int | None):
        if lookup not in self._llamas:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = None if lookup is None else LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_NGRAM,
                                                                          num_pred_tokens=lookup)
            # With a draft model Llama keeps every position's logits, but sizes that buffer by the logits_all
            # argument (n_batch rows when False): a prompt longer than n_batch would not fit, so say it.
            self._llamas[lookup] = llama_cpp.Llama(
                model_path=str(self.gguf), n_ctx=self.n_ctx, n_batch=min(512, self.n_ctx), n_threads=self.threads,
                n_threads_batch=self.threads, flash_attn=True, n_gpu_layers=0, draft_model=draft,
                logits_all=draft is not None, verbose=False)
        return self._llamas[lookup]

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 seed: int, lookup: int | None = None) -> tuple[int, float]:
        """(new tokens, seconds) of one generation: exactly max_new_tokens tokens, end of generation ignored."""
        tokens, seconds = self.generate_ids(ids, max_new_tokens, temperature, top_k, top_p, seed, lookup)
        return len(tokens), seconds

    def generate_ids(self, ids: list[int], max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                     seed: int, lookup: int | None = None, stop_ids: set[int] | None = None) -> tuple[list[int], float]:
        """(new token ids, seconds) of one generation: max_new_tokens tokens, or fewer when stop_ids is given and
        one of them comes (kept and counted, as ours counts its end-of-generation token)."""
        llm = self._llama(lookup)
        if len(ids) + max_new_tokens + (lookup or 0) > self.n_ctx:
            raise ValueError(f"a {len(ids)}-token prompt and {max_new_tokens} new tokens do not fit the llama.cpp "
                             f"peers' context of {self.n_ctx}")
        llm.reset()  # a fresh prefill: Llama would otherwise reuse the cached prefix of the last run's prompt
        llm.set_seed(seed & 0xFFFFFFFF)
        new = []
        stop_ids = stop_ids or set()
        t0 = time.perf_counter()
        tokens = llm.generate(ids, temp=float(temperature), top_k=int(top_k), top_p=float(top_p), min_p=0.0,
                              typical_p=1.0, repeat_penalty=1.0, reset=False)
        for token in tokens:
            new.append(int(token))
            if len(new) == max_new_tokens or token in stop_ids:
                break
        seconds = time.perf_counter() - t0
        tokens.close()
        return new, seconds

    def complete_json(self, ids: list[int], schema: dict, max_new_tokens: int, temperature: float, top_k: int,
                      top_p: float, seed: int) -> tuple[int, float, str]:
        """(new tokens, seconds, text) of one completion that follows schema, as a llama-cpp-python user gets it:
        `create_completion` with the schema's grammar (what `response_format={"type": "json_object", "schema":
        ...}` builds). It stops at the end of the JSON value (its end-of-generation token is counted, as ours is)
        or after max_new_tokens."""
        import json

        from llama_cpp import LlamaGrammar

        llm = self._llama(None)
        if len(ids) + max_new_tokens > self.n_ctx:
            raise ValueError(f"a {len(ids)}-token prompt and {max_new_tokens} new tokens do not fit the llama.cpp "
                             f"peers' context of {self.n_ctx}")
        key = json.dumps(schema, sort_keys=True)
        if key not in self._grammars:  # a user converts a schema once, too
            self._grammars[key] = LlamaGrammar.from_json_schema(key, verbose=False)
        llm.reset()  # a fresh prefill, as for llamacpp-plain
        t0 = time.perf_counter()
        out = llm.create_completion(list(ids), max_tokens=max_new_tokens, temperature=float(temperature),
                                    top_k=int(top_k), top_p=float(top_p), min_p=0.0, typical_p=1.0,
                                    repeat_penalty=1.0, seed=seed & 0xFFFFFFFF, grammar=self._grammars[key])
        seconds = time.perf_counter() - t0
        choice = out["choices"][0]
        n = out["usage"]["completion_tokens"] + (choice["finish_reason"] == "stop")
        return n, seconds, choice["text"]

    def close(self) -> None:
        for llm in self._llamas.values():
            llm.close()
        self._llamas.clear()


# ----------------------------------------------------------------------------------------------- llama-speculative
_FLOAT = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+|nan|inf)"
_TIMED = re.compile(rf"(encoded|decoded)\s+(\d+)\s+tokens\s+in\s+({_FLOAT})\s+seconds,\s+speed:\s+({_FLOAT})\s+t/s",
                    re.IGNORECASE)
_COUNT = re.compile(r"(?<![\w.])(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)")
_ACCEPT = re.compile(rf"(?<![\w.])accept\s*=\s*({_FLOAT})\s*%", re.IGNORECASE)


@dataclasses.dataclass
class SpeculativeRun:
    """What llama-speculative prints about one run."""

    prompt_tokens: int
    prompt_seconds: float
    new_tokens: int
    decode_seconds: float
    decode_tokens_per_second: float
    n_draft: int | None = None
    n_drafted: int | None = None
    n_accept: int | None = None
    accept_percent: float | None = None

    @property
    def seconds(self) -> float:
        """End to end as ours: the prompt evaluation and the decoding."""
        return self.prompt_seconds + self.decode_seconds


def parse_speculative_output(text: str) -> SpeculativeRun:
    """The numbers llama-speculative / llama-speculative-simple print at the end of a run.

    Their formats (examples/speculative/speculative.cpp): "encoded %4d tokens in %8.3f seconds, speed: %8.3f t/s",
    "decoded %4d tokens in %8.3f seconds, speed: %8.3f t/s", then "n_draft   = %d", "n_predict = %d",
    "n_drafted = %d", "n_accept  = %d", "accept    = %.3f%%" (speculative-simple prints no n_drafted / accept
    in older versions). Log prefixes (a function name, a timestamp) are tolerated; the last occurrence wins.
    """
    timed = {kind.lower(): (int(n), float(s), float(v)) for kind, n, s, v in _TIMED.findall(text)}
    if "decoded" not in timed:
        tail = "\n".join(text.strip().splitlines()[-5:])
        raise ValueError(f"llama-speculative printed no 'decoded N tokens in T seconds' line; its output ended "
                         f"with:\n{tail}")
    counts = {name: int(value) for name, value in _COUNT.findall(text)}
    accepts = _ACCEPT.findall(text)
    accept = float(accepts[-1]) if accepts else None
    n_enc, s_enc, _ = timed.get("encoded", (0, 0.0, 0.0))
    n_dec, s_dec, speed = timed["decoded"]
    return SpeculativeRun(prompt_tokens=n_enc, prompt_seconds=s_enc, new_tokens=n_dec, decode_seconds=s_dec,
                          decode_tokens_per_second=speed, n_draft=counts.get("n_draft"),
                          n_drafted=counts.get("n_drafted"), n_accept=counts.get("n_accept"),
                          accept_percent=accept if accept is not None and math.isfinite(accept) else None)


@dataclasses.dataclass
class SpeculativeBinary:
    """A llama-speculative binary and the spelling of its options (they changed across llama.cpp versions)."""

    path: str
    draft_max_flag: str  # --spec-draft-n-max, --draft-max, or the old --draft
    flash_attn: list[str]  # ["-fa", "on"] (newer) or ["-fa"]
    ignore_eos: bool

    @classmethod
    def find(cls, path: str, timeout: float = 60.0) -> "SpeculativeBinary":
        resolved = shutil.which(path) or (path if os.path.isfile(path) else None)
        if resolved is None or not os.access(resolved, os.X_OK):
            raise FileNotFoundError(f"--llama-speculative {path}: no such executable; build it from llama.cpp "
                                    f"(cmake --build build --target llama-speculative)")
        try:
            help_text = subprocess.run([resolved, "--help"], capture_output=True, text=True, timeout=timeout,
                                       errors="replace")
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{resolved} --help did not answer within {timeout:g} s") from None
        text = help_text.stdout + help_text.stderr
        if "--model-draft" not in text and "-md" not in text:
            raise ValueError(f"{resolved} does not look like llama-speculative (its --help names no --model-draft)")
        flag = next((f for f in ("--spec-draft-n-max", "--draft-max") if f in text), "--draft")
        fa = ["-fa", "on"] if re.search(r"--flash-attn\s*\[?\s*on\|off", text) or "[on|off|auto]" in text else ["-fa"]
        return cls(resolved, flag, fa, "--ignore-eos" in text)

    def command(self, target: Path, draft: Path, prompt_file: str, max_new_tokens: int, draft_max: int,
                threads: int, n_ctx: int, temperature: float, top_k: int, top_p: float, seed: int) -> list[str]:
        cmd = [self.path, "-m", str(target), "-md", str(draft), "-f", prompt_file, "-n", str(max_new_tokens),
               "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads), "-ngl", "0", "-ngld", "0",
               self.draft_max_flag, str(draft_max), *self.flash_attn, "--temp", f"{temperature:g}",
               "--top-k", str(top_k), "--top-p", f"{top_p:g}", "--min-p", "0", "--repeat-penalty", "1",
               "--seed", str(seed & 0x7FFFFFFF)]
        return cmd + (["--ignore-eos"] if self.ignore_eos else [])

    def run(self, *args, timeout: float = 600.0, **kwargs) -> tuple[SpeculativeRun, list[str]]:
        cmd = self.command(*args, **kwargs)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"llama-speculative ran past {timeout:g} s: {' '.join(cmd)}") from None
        output = done.stdout + "\n" + done.stderr
        if done.returncode != 0:
            tail = "\n".join(output.strip().splitlines()[-8:])
            raise RuntimeError(f"llama-speculative failed (exit {done.returncode}): {' '.join(cmd)}\n{tail}")
        return parse_speculative_output(output), cmd


def write_prompt(text: str) -> str:
    """The prompt in a temporary file for -f (a chat prompt holds newlines and special tokens); the caller
    removes it."""
    fd, name = tempfile.mkstemp(prefix="specdecode-prompt-", suffix=".txt")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return name
