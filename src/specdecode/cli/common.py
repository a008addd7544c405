"""What every command shares: model options, loading the pair, error reporting, the console."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Optional

import typer
from rich.console import Console

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

# Progress bars and status lines go to stderr so stdout stays clean for text and --json.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False)


class CLIError(Exception):
    """A problem the user can fix; printed as one line, exit code 1."""


def fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    raise typer.Exit(code)


@contextlib.contextmanager
def user_errors():
    """Turn the library's expected errors into one clear line and a non-zero exit, never a traceback."""
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except (CLIError, ValueError, FileNotFoundError, RuntimeError, ImportError, OSError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


# Option declarations shared by generate, compare, bench, eval, verify and serve.
TargetOpt = typer.Option(DEFAULT_TARGET, "--target", "-t", help="Target model: a built-in name, an HF directory, "
                         "a .gguf file, or a hub id in the local HF cache.")
DraftOpt = typer.Option(DEFAULT_DRAFT, "--draft", "-d", help="Draft model (same kinds as --target), or 'none' "
                        "for plain decoding of the target.")
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

    @property
    def has_draft(self) -> bool:
        return self.draft is not None and self.draft.lower() != "none"


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
                            progress=not quiet)
    draft = None
    if opts.has_draft:
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
