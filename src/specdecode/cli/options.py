"""The options commands share, each declared once.

`@model_options(...)` replaces a command's `opts: ModelOptions` parameter by the shared model options (target,
draft, -k, method, backend, device, dtype, quantization, prepacking, threads, remote code) and hands the command
one ModelOptions (specdecode.pairing.pair) built from them. `@sampling_options(...)` does the same for --temperature,
--top-k, --top-p, --seed, --min-p, the penalties and --logit-bias, handing a SamplingOptions checked by
SamplingParams. A new option is one field and
one declaration below, for every command. Values are checked by the library (Speculation.parse for -k,
SamplingParams for sampling, the backend registry for --backend), here before the command runs; the CLI only
words the error with its flag.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass, fields
from typing import Optional

import typer

from ..backends import backend_help
from .console import FLAGS, CLIError, flag, user_errors  # noqa: F401  (CLIError, FLAGS: where callers have found them)
from ..pairing.pair import DEFAULT_DRAFT, DEFAULT_TARGET, ModelOptions, parse_k, parse_k_list  # noqa: F401  (re-exported)
from ..pairing.pair import AUTO_DRAFT, DEFAULT_SUFFIX_HISTORY_TOKENS  # noqa: F401  (AUTO_DRAFT: the commands' default)
from ..pairing.pair import check_target_ahead
from ..policy.speculation import AUTO

PANEL = "Models and speculation"
SAMPLING_PANEL = "Sampling"


def _backend_help() -> str:
    listed = ", ".join(f"{name} ({help})" for name, help in backend_help().items())
    return f"How the models run: {listed}, or auto (a backend that claims the model, transformers otherwise)."


def _model_declarations(k_default: str, k_list: bool, draft_default: str = DEFAULT_DRAFT) -> dict:
    """field name -> (annotation, typer.Option), in the order the help lists them."""
    k_help = ("Draft tokens per verification: auto (the engine adapts it step by step), a number (0: plain "
              "decoding with the draft loaded)" + ("; a comma list (auto,2,4) compares them." if k_list else "."))
    option = functools.partial(typer.Option, rich_help_panel=PANEL)
    return {
        "target": (str, option(DEFAULT_TARGET, "--target", "-t", help="Target model: a built-in name, an HF "
                                "directory, a .gguf file, or a hub id in the local HF cache.")),
        "draft": (str, option(draft_default, "--draft", "-d", help="'auto': decide from the draft model's costs "
                               "measured on this machine whether it can pay (then suffix+MODEL), else draft with "
                               "what costs nothing (suffix) and never load it; a draft model (same kinds as "
                               "--target); 'prompt-lookup' to draft by copying from the context (no second model); "
                               "'suffix' to copy from the context and earlier requests (no second model); "
                               "'suffix+MODEL' to copy where the suffix index is confident and draft with MODEL "
                               "elsewhere; 'none' for plain decoding of the target.")),
        "k": (str, option(k_default, "-k", "--num-speculative-tokens", help=k_help)),
        "method": (str, option("leviathan", "--method", help="Rejection sampler: leviathan (Alg. 1, vectorised) "
                               "or chen (Alg. 2, sequential). Both are lossless.")),
        "backend": (str, option("auto", "--backend", help=_backend_help())),
        "compile": (bool, option(False, "--compile", help="Run the static backend's small steps (drafting, "
                                 "verification) through torch.compile: fused kernels, on CUDA replayed as CUDA "
                                 "graphs. Every step shape is compiled and run once at load, before the first "
                                 "request (at most 60 s a model; the time is printed). Implies --backend static; "
                                 "for GPUs (on a CPU a compile takes minutes).")),
        "device": (str, option("cpu", "--device", help="cpu, cuda, cuda:N or auto.")),
        "dtype": (str, option("auto", "--dtype", help="float32, float16, bfloat16 or auto (fp32 on CPU, fp16 on "
                              "CUDA).")),
        "device_map": (Optional[str], option(None, "--device-map", help="'auto': shard the target over the "
                                             "available GPUs (accelerate), for targets that do not fit one GPU.")),
        "quantize": (Optional[str], option(None, "--quantize", help="Quantize the TARGET: int8 (CPU: torch "
                                           "dynamic int8 Linear; CUDA: bitsandbytes), int4 (CUDA, bitsandbytes) or "
                                           "none. Changes the target's numerics.")),
        "draft_quantize": (Optional[str], option("auto", "--draft-quantize", help="Quantize only the DRAFT: int8, "
                                                 "int4, none, or auto (int8 on CPU, where it makes drafting several "
                                                 "times cheaper; a GGUF draft on llama.cpp: a copy with its heavier "
                                                 "matrices in Q4_0, made once, where it drafts faster). Only q "
                                                 "changes, so the output keeps exactly the target's distribution.")),
        "prepack": (bool, option(True, "--prepack/--no-prepack", help="On the CPU, prepack the target's fp32 "
                                 "Linear weights (oneDNN blocked layout): verifying K+1 tokens then costs about one "
                                 "decode step. Same function up to fp32 rounding; used for plain decoding too.")),
        "threads": (Optional[int], option(None, "--threads", help="CPU threads (llama.cpp's; torch's for "
                                          "transformers). Default: llama.cpp every core, torch its own choice.")),
        "exact_greedy": (bool, option(False, "--exact-greedy", help="llama.cpp: verify in forwards of <= 3 tokens "
                                      "so greedy output is token-for-token llama.cpp's own (its kernels for 4+ "
                                      "tokens round differently and can flip a near-tie); slower. On 2+ threads "
                                      "it speculates below position 256 only (llama.cpp's one-token step splits "
                                      "its attention from there).")),
        "huge_pages": (bool, option(True, "--huge-pages/--no-huge-pages", help="llama.cpp: collapse the model's "
                                    "memory into transparent huge pages in the background (Linux; fewer TLB misses: "
                                    "~8% faster steps measured on a 1.5B model; the same outputs).")),
        "trust_remote_code": (bool, option(False, "--trust-remote-code", help="Allow a model's own Python code "
                                           "(off by default).")),
        "suffix_history_tokens": (int, option(DEFAULT_SUFFIX_HISTORY_TOKENS, "--suffix-history-tokens",
                                              help="--draft suffix(+MODEL): tokens of earlier prompts and outputs "
                                              "kept to draft from (least recently used out first; 0: none).")),
        "tree_width": (int, option(1, "--tree-width", help="--draft suffix: propose token trees, up to this many "
                                   "continuations per node, verified in one forward as wide as the chain's "
                                   "(llama.cpp: the target is built with one KV stream for all rows). 1: chains.")),
    }


def model_options(k_default: str = AUTO, k_list: bool = False, draft_default: str = DEFAULT_DRAFT):
    """Give a Typer command the shared model options in place of its `opts: ModelOptions` parameter.

    k_default: the default of -k ("auto" or a number); k_list: -k takes a comma list (read it with opts.k_values).
    -k is parsed before the command runs. draft_default: AUTO_DRAFT where the command decodes (generate, serve,
    bench); the draft model where it studies the draft (compare, advise, bench verify/eval/latency).
    """
    declared = _model_declarations(k_default, k_list, draft_default)
    assert set(declared) == {f.name for f in fields(ModelOptions)}, "every ModelOptions field needs an option"

    def build(values: dict) -> ModelOptions:
        opts = ModelOptions(**values)
        opts.k_values if k_list else opts.num_speculative_tokens  # noqa: B018  (Speculation.parse, early)
        check_target_ahead(opts)  # the first use's checksum on the core the imports that follow leave idle
        return opts

    return functools.partial(_replace_parameter, name="opts", declared=declared, build=build)


# ---------------------------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class SamplingOptions:
    """--temperature, --top-k, --top-p and --seed as SamplingParams checked and normalised them (a temperature
    below 1e-5 is 0.0: greedy). temperatures and seeds hold one value each unless the command takes comma lists."""

    temperatures: tuple[float, ...]
    top_k: int
    top_p: float
    seeds: tuple[Optional[int], ...]
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def temperature(self) -> float:
        return self.temperatures[0]

    @property
    def seed(self) -> Optional[int]:
        return self.seeds[0]

    @property
    def greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)

    def generation_params(self, **options):
        """The engine's GenerationParams of the first temperature and seed, with these other fields (max_new_tokens,
        stop, a constraint, ...); what a command that generates hands generate() or stream()."""
        from ..engine.params import GenerationParams

        return GenerationParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                                **{name: getattr(self, name) for name in OPTIONS}, **options)

    @property
    def params(self):
        """The first temperature's SamplingParams (what a command that samples one setting checks against)."""
        from ..exact.sampling import SamplingParams

        return SamplingParams(self.temperature, self.top_k, self.top_p,
                              **{name: getattr(self, name) for name in OPTIONS})


SAMPLING_HELP = {
    "temperature": "0 = greedy; > 0 samples from the target's distribution at this temperature.",
    "top_k": "Sample only from the k most likely tokens (0 = off).",
    "top_p": "Nucleus sampling mass in (0, 1] (1.0 = off).",
    "seed": "Seed for sampling.",
    "min_p": "Drop tokens below MIN_P x the top token's probability, after top-p (0 = off; transformers' order).",
    "presence_penalty": "Subtract this (-2..2) from the logit of every token the output already holds (OpenAI).",
    "frequency_penalty": "Subtract this (-2..2) times its count in the output from each token's logit (OpenAI).",
    "repetition_penalty": "Divide positive and multiply negative logits of the tokens in prompt + output by this "
                          "(> 0; 1 = off; transformers, vLLM).",
    "logit_bias": "Add to raw logits: TOKEN_ID:VALUE pairs, comma separated (50256:-100,13:2.5), or a JSON object; "
                  "values in [-100, 100].",
}
OPTIONS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")  # beyond warping


def sampling_options(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                     lists: tuple[str, ...] = (),
                     only: tuple[str, ...] = ("temperature", "top_k", "top_p", "seed", *OPTIONS),
                     help: Optional[dict] = None):
    """Give a Typer command --temperature, --top-k, --top-p, --seed, --min-p, --presence-penalty,
    --frequency-penalty, --repetition-penalty and --logit-bias in place of its `sampling: SamplingOptions`
    parameter, with these defaults.

    lists: of "temperature" and "seed", those that take a comma list (0,0.7,1). only: the options the command
    has (the others keep their defaults). help: field -> help text replacing the shared one.
    """
    texts = {**SAMPLING_HELP, **(help or {})}
    for name in lists:
        texts[name] += " A comma list (0,0.7,1) sweeps them." if name == "temperature" else \
            " A comma list (0,1,2) pools them."
    defaults = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed, "min_p": 0.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None}
    types = {"temperature": float, "top_k": int, "top_p": float, "seed": Optional[int], "min_p": float,
             "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float,
             "logit_bias": Optional[str]}
    option = functools.partial(typer.Option, rich_help_panel=SAMPLING_PANEL)
    declared = {}
    for name in only:
        default, kind = defaults[name], types[name]
        if name in lists:  # typed as text, read as a comma list
            default, kind = (None if default is None else str(default)), (Optional[str] if default is None else str)
        declared[name] = (kind, option(default, flag(name), help=texts[name]))

    def build(values: dict) -> SamplingOptions:
        values = {**defaults, **values}
        temperatures = _numbers(values["temperature"], float, "temperature")
        seeds = _numbers(values["seed"], int, "seed") if values["seed"] is not None else (None,)
        options = {name: values[name] for name in OPTIONS if name != "logit_bias"}
        options["logit_bias"] = _logit_bias(values["logit_bias"])
        params = [_sampling_params(t, values["top_k"], values["top_p"], options) for t in temperatures]
        return SamplingOptions(tuple(dict.fromkeys(p.temperature for p in params)), params[0].top_k,
                               params[0].top_p, seeds, **{name: getattr(params[0], name) for name in OPTIONS})

    return functools.partial(_replace_parameter, name="sampling", declared=declared, build=build)


def _sampling_params(temperature, top_k, top_p, options: dict):
    from ..errors import OptionError
    from ..exact.sampling import SamplingParams

    try:
        return SamplingParams(temperature, top_k, top_p, **options)
    except ValueError as e:  # its messages start with the field's name
        raise OptionError(str(e).split(" ", 1)[0], str(e)) from None


def _logit_bias(text: Optional[str]) -> dict:
    """--logit-bias: TOKEN_ID:VALUE pairs separated by commas, or a JSON object {"TOKEN_ID": VALUE}."""
    if not text or not text.strip():
        return {}
    try:
        if text.strip().startswith("{"):
            pairs = list(json.loads(text).items())
        else:
            pairs = [part.split(":") for part in text.split(",") if part.strip()]
        return {int(str(token).strip()): float(value) for token, value in pairs}
    except (ValueError, TypeError, AttributeError):
        raise CLIError(f"--logit-bias takes TOKEN_ID:VALUE pairs separated by commas (50256:-100,13:2.5) or a "
                       f"JSON object ({{\"50256\": -100}}), got {text!r}") from None


def _numbers(value, kind, option: str) -> tuple:
    """A number, or the numbers of a comma list."""
    if not isinstance(value, str):
        return (value,)
    try:
        numbers = tuple(kind(part) for part in value.split(",") if part.strip())
    except ValueError:
        numbers = ()
    if not numbers:
        raise CLIError(f"{flag(option)} takes a number or a comma list of numbers, got {value!r}")
    return numbers


# ---------------------------------------------------------------------------------------------- the decorator
def _replace_parameter(command, name: str, declared: dict, build):
    """command with its parameter `name` replaced by the declared options; the wrapper hands it build(values).

    build runs before the command, with the CLI's one-line errors: a bad value costs nothing.
    """
    signature = inspect.signature(command)
    names = list(signature.parameters)
    if name not in names:
        raise TypeError(f"{command.__name__} needs a `{name}` parameter for this decorator")
    at = names.index(name)
    params = list(signature.parameters.values())
    params[at:at + 1] = [inspect.Parameter(field, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option,
                                           annotation=annotation) for field, (annotation, option) in declared.items()]
    # Typer hands the command's context to one parameter of this type: the command's own, else one added here
    own = [p.name for p in params if p.annotation is typer.Context or str(p.annotation).endswith("typer.Context")]
    context = own[0] if own else f"_{name}_context"
    if not own:
        params.append(inspect.Parameter(context, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        values = {field: kwargs.pop(field) for field in declared}
        ctx = kwargs.get(context) if own else kwargs.pop(context, None)
        with user_errors():
            built = build(values)
        if isinstance(built, ModelOptions):  # what the user typed, for cli/applies.py (not a field: no Ray config)
            built.given = given_on_command_line(ctx)
        return command(*args, **{name: built}, **kwargs)

    # Typer reads the parameters from the signature and their types from __annotations__ (strings are resolved in
    # the command's module).
    wrapper.__signature__ = signature.replace(parameters=params)
    annotations = {k: v for k, v in command.__annotations__.items() if k != name}
    wrapper.__annotations__ = {**annotations, **{field: a for field, (a, _) in declared.items()},
                               **({} if own else {context: typer.Context})}
    return wrapper


def given_on_command_line(ctx) -> frozenset:
    """The parameters of a command's context given on the command line or from the environment, not defaulted."""
    if ctx is None:
        return frozenset()
    sources = {name: ctx.get_parameter_source(name) for name in (p.name for p in ctx.command.params)}
    return frozenset(name for name, source in sources.items()
                     if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT"))
