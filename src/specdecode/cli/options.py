"""The options every model-running command shares, declared once.

`@model_options(...)` replaces a command's `opts: ModelOptions` parameter by the shared options (target, draft,
-k, method, backend, device, dtype, quantization, prepacking, threads, remote code) and hands the command one
ModelOptions built from them. A new loading option is one field and one declaration below, for every command.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields
from typing import Optional, Union

import typer

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
AUTO = "auto"
QUANTIZATIONS = (None, "none", "auto", "int8", "int4")
PANEL = "Models and speculation"

Speculation = Union[int, str]  # a number of draft tokens per step, or "auto" (the engine adapts it)


class CLIError(Exception):
    """A problem the user can fix; printed as one line, exit code 1."""


@dataclass
class ModelOptions:
    target: str = DEFAULT_TARGET
    draft: Optional[str] = DEFAULT_DRAFT
    k: str = AUTO  # as typed: "auto", an integer, or (bench) a comma list of those
    method: str = "leviathan"
    backend: str = "auto"
    device: str = "cpu"
    dtype: str = "auto"
    device_map: Optional[str] = None
    quantize: Optional[str] = None
    draft_quantize: Optional[str] = "auto"
    prepack: bool = True
    threads: Optional[int] = None
    exact_greedy: bool = False
    trust_remote_code: bool = False

    @property
    def has_draft(self) -> bool:
        return self.draft is not None and self.draft.lower() != "none"

    @property
    def draft_is_lookup(self) -> bool:
        """--draft prompt-lookup: draft by copying n-grams of the context, no second model."""
        return self.has_draft and self.draft.lower() == "prompt-lookup"

    @property
    def num_speculative_tokens(self) -> Speculation:
        return parse_k(self.k)

    @property
    def k_values(self) -> list[Speculation]:
        return parse_k_list(self.k)


def parse_k(text) -> Speculation:
    """-k as the engine takes it: the string "auto" or an integer >= 1."""
    value = str(text).strip().lower()
    if value == AUTO:
        return AUTO
    try:
        k = int(value)
    except ValueError:
        raise CLIError(f"-k must be auto or an integer >= 1, got {text!r}") from None
    if k < 1:
        raise CLIError(f"-k (draft tokens per step) must be >= 1, got {k}; use --draft none for plain decoding")
    return k


def parse_k_list(text) -> list[Speculation]:
    """A comma list of -k values (auto,2,4), each once, in the order given."""
    values = [parse_k(part) for part in str(text).split(",") if part.strip()]
    if not values:
        raise CLIError(f"-k needs at least one value (auto or an integer), got {text!r}")
    return list(dict.fromkeys(values))


def _declarations(k_default: str, k_list: bool) -> dict:
    """field name → (annotation, typer.Option), in the order the help lists them."""
    k_help = ("Draft tokens per verification: auto (the engine adapts it step by step) or a number; a comma "
              "list (auto,2,4) compares them." if k_list else
              "Draft tokens per verification: auto (the engine adapts it step by step) or a number.")
    option = functools.partial(typer.Option, rich_help_panel=PANEL)
    return {
        "target": (str, option(DEFAULT_TARGET, "--target", "-t", help="Target model: a built-in name, an HF "
                                "directory, a .gguf file, or a hub id in the local HF cache.")),
        "draft": (str, option(DEFAULT_DRAFT, "--draft", "-d", help="Draft model (same kinds as --target); "
                               "'prompt-lookup' to draft by copying from the context (no second model); 'none' "
                               "for plain decoding of the target.")),
        "k": (str, option(k_default, "-k", "--num-speculative-tokens", help=k_help)),
        "method": (str, option("leviathan", "--method", help="Rejection sampler: leviathan (Alg. 1, vectorised) "
                               "or chen (Alg. 2, sequential). Both are lossless.")),
        "backend": (str, option("auto", "--backend", help="How the models run: transformers, static (transformers "
                                "on a preallocated KV cache with CUDA graphs, for GPUs), llamacpp (GGUF on llama.cpp's "
                                "kernels), or auto (llamacpp for GGUF models on a CPU when installed).")),
        "device": (str, option("cpu", "--device", help="cpu, cuda, cuda:N or auto.")),
        "dtype": (str, option("auto", "--dtype", help="float32, float16, bfloat16 or auto (fp32 on CPU, fp16 on "
                              "CUDA).")),
        "device_map": (Optional[str], option(None, "--device-map", help="'auto': shard the target over the "
                                             "available GPUs (accelerate), for targets that do not fit one GPU.")),
        "quantize": (Optional[str], option(None, "--quantize", help="Quantize the TARGET: int8 (CPU: torch "
                                           "dynamic int8 Linear; CUDA: bitsandbytes) or int4 (CUDA, bitsandbytes). "
                                           "Changes the target's numerics.")),
        "draft_quantize": (Optional[str], option("auto", "--draft-quantize", help="Quantize only the DRAFT: int8, "
                                                 "int4, none, or auto (int8 on CPU, where it makes drafting several "
                                                 "times cheaper). Only q changes, so the output keeps exactly the "
                                                 "target's distribution.")),
        "prepack": (bool, option(True, "--prepack/--no-prepack", help="On the CPU, prepack the target's fp32 "
                                 "Linear weights (oneDNN blocked layout): verifying K+1 tokens then costs about one "
                                 "decode step. Same function up to fp32 rounding; used for plain decoding too.")),
        "threads": (Optional[int], option(None, "--threads", help="CPU threads (llama.cpp's; torch's for "
                                          "transformers). Default: llama.cpp every core, torch its own choice.")),
        "exact_greedy": (bool, option(False, "--exact-greedy", help="llama.cpp: verify in forwards of <= 3 tokens "
                                      "so greedy output is token-for-token llama.cpp's own (its kernels for 4+ "
                                      "tokens round differently and can flip a near-tie); slower.")),
        "trust_remote_code": (bool, option(False, "--trust-remote-code", help="Allow a model's own Python code "
                                           "(off by default).")),
    }


def model_options(k_default: str = AUTO, k_list: bool = False):
    """Give a Typer command the shared model options in place of its `opts: ModelOptions` parameter.

    k_default: the default of -k ("auto" or a number); k_list: -k takes a comma list (read it with opts.k_values).
    """
    declared = _declarations(k_default, k_list)
    assert set(declared) == {f.name for f in fields(ModelOptions)}, "every ModelOptions field needs an option"

    def decorate(command):
        signature = inspect.signature(command)
        names = list(signature.parameters)
        if "opts" not in names:
            raise TypeError(f"{command.__name__} needs an `opts: ModelOptions` parameter for @model_options")
        at = names.index("opts")
        shared = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option,
                                    annotation=annotation) for name, (annotation, option) in declared.items()]
        params = list(signature.parameters.values())
        params[at:at + 1] = shared

        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            opts = ModelOptions(**{name: kwargs.pop(name) for name in declared})
            return command(*args, opts=opts, **kwargs)

        # Typer reads the parameters from the signature and their types from __annotations__ (strings are
        # resolved in the command's module).
        wrapper.__signature__ = signature.replace(parameters=params)
        annotations = {k: v for k, v in command.__annotations__.items() if k != "opts"}
        wrapper.__annotations__ = {**annotations, **{name: a for name, (a, _) in declared.items()}}
        return wrapper

    return decorate
