"""Loading a model and its tokenizer, offline: a built-in name, a local HF directory, a .gguf file, or a hub id
already in the local Hugging Face cache. Nothing is ever downloaded, no pickled weights and no remote code are
loaded unless asked for.

Three backends: transformers (any of the above, on CPU or GPU), static (a transformers model on a preallocated KV
cache, with CUDA graphs on a GPU; Llama/Mistral/Qwen2/Qwen3/Gemma) and llama.cpp (GGUF models on the CPU, through
llama-cpp-python: the GGUF runs as it is, quantized, on llama.cpp's kernels). `backend="auto"` picks llama.cpp for
a GGUF model on the CPU when llama-cpp-python is installed.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .prepare import Progress, gguf_tokenizer_dir, prepare_gguf, prepare_model

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
QUANTIZE = ("int8", "int4")
BACKENDS = ("auto", "transformers", "static", "llamacpp")


class ModelNotFoundError(FileNotFoundError):
    pass


class DeviceUnavailableError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer; the generators accept it wherever they accept a model.

    model: a transformers model (backend "transformers"), a StaticBackend (backend "static") or a LlamaCppBackend
    (backend "llamacpp").
    """

    model: Any
    tokenizer: object | None
    name: str
    path: str
    backend: str = "transformers"


def resolve_device(device: str | None) -> torch.device:
    device = (device or "cpu").lower()
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"device {device!r} was requested but no CUDA GPU is available here (torch {torch.__version__}, "
            f"cuda available: False): use --device cpu, or auto to pick the GPU only when there is one")
    if device not in ("cpu", "mps") and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto")
    return torch.device(device)


def resolve_dtype(dtype, device: torch.device):
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        # fp32 on CPU: this CPU class has no bf16 arithmetic, and half precision is slower there.
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of float32, float16, bfloat16, auto")
    return DTYPES[dtype]


def _locate(name_or_path: str, progress: Progress | bool | None = None) -> tuple[str, dict]:
    """(directory or hub id, extra from_pretrained kwargs) for a name, a path or a cached hub id."""
    path = Path(os.path.expanduser(name_or_path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is a directory but has no config.json: not a Hugging Face model "
                                     f"directory")
        return str(path), {}
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf model: give a .gguf file or an HF directory")
        return str(path.parent), {"gguf_file": path.name}
    from . import registry

    if registry.is_registered(name_or_path):
        return str(prepare_model(name_or_path, progress=progress)), {}
    if "/" in name_or_path and not name_or_path.startswith((".", "/", "~")):
        return name_or_path, {"local_files_only": True}
    known = ", ".join(m.name for m in registry.list_models())
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found: it is not a built-in name ({known}), not a local directory or .gguf "
        f"file, and not a hub id (org/name). Nothing is downloaded at run time.")


def load_model(name_or_path, device: str = "cpu", dtype="auto", trust_remote_code: bool = False,
               device_map: str | None = None, quantize: str | None = None, prepack: bool = False,
               progress: Progress | bool | None = None, backend: str = "auto", threads: int | None = None,
               backend_options: dict | None = None, exact_greedy: bool = False,
               max_rows: int | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer offline.

    max_rows: rows the model must decode at once (a server's batch): llama.cpp is built with that many sequences
    (default 1, and a batch of more rows is refused); the other backends take any batch and ignore it.
    exact_greedy: on llama.cpp, verify in forwards of at most 3 tokens (its kernels for 4 or more tokens round
    differently), so that greedy output is token-for-token llama.cpp's own; slower. No effect elsewhere.

    name_or_path: a built-in name (see `specdecode models list`), a local HF directory, a .gguf file, or a hub
    id already in the local HF cache; a transformers model passes through. quantize: "int8" (CPU: torch's
    dynamic int8 Linear layers; CUDA: bitsandbytes) or "int4" (CUDA, bitsandbytes). Quantizing only the draft
    keeps the output exactly the target's distribution. prepack: on the CPU, store fp32 Linear weights in
    oneDNN's blocked layout, which makes a forward of a few tokens (speculative verification) cost about one
    decode step; the same function up to fp32 rounding (see models/optimize.py). Ignored off the CPU, for
    quantized models, and for non-fp32 models.

    backend: "transformers", "static" (the transformers model on StaticBackend: preallocated KV cache, CUDA
    graphs on a GPU), "llamacpp" (a GGUF model, built-in or a .gguf file, on llama.cpp's CPU kernels;
    needs llama-cpp-python; dtype, quantize and prepack do not apply: the GGUF runs as it is quantized), or
    "auto": llamacpp for a GGUF model on the CPU when llama-cpp-python is installed, transformers otherwise.
    The result's `backend` field says which. threads: CPU threads (llama.cpp's, or torch's for transformers;
    default: llama.cpp uses every core, torch keeps its setting). backend_options: keyword arguments for the
    backend (llamacpp: n_ctx, max_rows, max_tokens_per_forward, flash_attn, use_mmap, repack; see
    LlamaCppBackend; static: max_batch, max_len, compile, cuda_graphs; see StaticBackend). progress: a callback
    (description, done, total) told how preparing a built-in model goes (see models/prepare.py), or None; nothing
    is drawn here (a bool, the former switch, means no callback).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if isinstance(name_or_path, PreTrainedModel):
        if backend == "llamacpp":
            raise ValueError("the llama.cpp backend loads GGUF files, not a transformers model object: pass the "
                             "model's name or .gguf path")
        if backend == "static":
            return _static(LoadedModel(name_or_path, None, type(name_or_path).__name__, ""), backend_options)
        return LoadedModel(name_or_path, None, type(name_or_path).__name__, "")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if _choose_backend(str(name_or_path), backend, device, device_map) == "llamacpp":
        if exact_greedy:
            backend_options = {"max_tokens_per_forward": 3, **(backend_options or {})}
        if max_rows is not None and max_rows > 1:
            backend_options = {"max_rows": max_rows, **(backend_options or {})}
        return _load_llamacpp(str(name_or_path), threads, progress, backend_options)
    if backend_options and backend != "static":
        raise ValueError(f"backend_options are for the llama.cpp and static backends; transformers takes none (got "
                         f"{sorted(backend_options)})")
    if threads is not None:
        torch.set_num_threads(threads)
    if quantize not in (None, *QUANTIZE):
        raise ValueError(f"unknown quantization {quantize!r}: use int8 or int4")
    target_device = resolve_device(device) if device_map is None else None
    torch_dtype = resolve_dtype(dtype, target_device or torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    source, extra = _locate(str(name_or_path), progress)
    kwargs = dict(extra, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if "gguf_file" not in extra:
        kwargs["use_safetensors"] = True  # never unpickle weights
    on_cuda = device_map is not None or target_device.type == "cuda"
    if quantize and on_cuda:
        kwargs["quantization_config"] = _bitsandbytes_config(quantize)
    if device_map is not None:
        _require_accelerate_gpu(device_map)
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as err:
        if extra.get("local_files_only"):
            raise ModelNotFoundError(
                f"{source!r} is not in the local Hugging Face cache and nothing is downloaded at run time: "
                f"download it beforehand, or give a local directory or .gguf file ({err})") from None
        if "safetensors" in str(err) or "pytorch_model.bin" in str(err):
            raise ModelNotFoundError(
                f"{source} has no safetensors weights; pickled weights (pytorch_model.bin) are not loaded because "
                f"unpickling can run arbitrary code: convert the checkpoint to safetensors first") from None
        raise
    if device_map is None and not (quantize and on_cuda):
        model = model.to(target_device)
    model.eval()
    if quantize and not on_cuda:
        model = _quantize_cpu(model, quantize)
    elif prepack and not on_cuda and torch_dtype == torch.float32 and torch.backends.mkldnn.is_available():
        from .optimize import prepack_linear_layers

        model = prepack_linear_layers(model)
    tokenizer_kwargs = {k: v for k, v in extra.items()}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **tokenizer_kwargs)
    except (OSError, ValueError):
        tokenizer = None  # token ids in, token ids out
    loaded = LoadedModel(model, tokenizer, str(name_or_path), source)
    return _static(loaded, backend_options) if backend == "static" else loaded


def _static(loaded: LoadedModel, options: dict | None) -> LoadedModel:
    """The loaded transformers model on a StaticBackend, its logits cut to the tokenizer's vocabulary."""
    from ..backends.static import StaticBackend

    vocab = len(loaded.tokenizer) if loaded.tokenizer is not None else None
    backend = StaticBackend(loaded.model, vocab_size=vocab, **(options or {}))
    return LoadedModel(backend, loaded.tokenizer, loaded.name, loaded.path, backend="static")


def _is_gguf(name_or_path: str) -> bool:
    """A .gguf file, or a built-in name (every built-in model is a GGUF) that is not also a local path."""
    from . import registry

    path = Path(os.path.expanduser(name_or_path))
    if path.exists():
        return path.is_file() and path.suffix == ".gguf"
    if not registry.is_registered(name_or_path):
        return False
    # a built-in whose packages are gone but whose converted directory is cached stays on transformers
    return registry.get_model_info(name_or_path).installed or registry.gguf_cache_path(name_or_path).exists()


def _choose_backend(name_or_path: str, backend: str, device, device_map) -> str:
    if backend in ("transformers", "static"):
        return backend
    on_cpu = device_map is None and resolve_device(device).type == "cpu"
    if backend == "auto":
        usable = _is_gguf(name_or_path) and on_cpu and importlib.util.find_spec("llama_cpp") is not None
        return "llamacpp" if usable else "transformers"
    if not _is_gguf(name_or_path):
        _locate(name_or_path, progress=False)  # a clear ModelNotFoundError when it is nothing at all
        raise ValueError(f"the llama.cpp backend runs GGUF models: {name_or_path!r} is neither a .gguf file nor a "
                         f"built-in model; use backend transformers")
    if not on_cpu:
        raise ValueError(f"the llama.cpp backend runs on the CPU, and device {device!r}"
                         f"{'' if device_map is None else f' / device_map {device_map!r}'} was asked for: use device "
                         f"cpu, or backend transformers for a GPU")
    if importlib.util.find_spec("llama_cpp") is None:
        from ..backends.llamacpp import INSTALL_HINT

        raise ImportError(INSTALL_HINT)
    return "llamacpp"


def _load_llamacpp(name_or_path: str, threads: int | None, progress: Progress | bool | None,
                   options: dict | None) -> LoadedModel:
    from transformers import AutoTokenizer

    from ..backends.llamacpp import LlamaCppBackend

    path = Path(os.path.expanduser(name_or_path))
    if path.is_file():
        gguf, tokenizer_dir = path, gguf_tokenizer_dir(path)
    else:
        gguf, tokenizer_dir = prepare_gguf(name_or_path, progress=progress)
    options = dict(options or {})
    if threads is not None:
        options["n_threads"] = threads
    model = LlamaCppBackend(gguf, name=name_or_path, **options)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir is not None else None
    if tokenizer is not None and len(tokenizer) < model.n_vocab:
        # An embedding padded past the tokenizer: logits of ids that no text can produce are dropped, as the
        # generators do for transformers models.
        model.vocab_size = len(tokenizer)
    return LoadedModel(model, tokenizer, name_or_path, str(gguf), backend="llamacpp")


def _bitsandbytes_config(quantize: str):
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise RuntimeError("--quantize on a GPU needs bitsandbytes: pip install bitsandbytes") from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=quantize == "int8", load_in_4bit=quantize == "int4")


def _require_accelerate_gpu(device_map: str) -> None:
    if device_map == "auto" and not torch.cuda.is_available():
        raise DeviceUnavailableError("--device-map auto shards a model over GPUs, and no CUDA GPU is available "
                                     "here: leave it out to load on the CPU")


def _quantize_cpu(model, quantize: str):
    if quantize == "int4":
        raise ValueError("int4 quantization needs a CUDA GPU (bitsandbytes); on the CPU use --quantize int8")
    from .optimize import quantize_dynamic_int8

    return quantize_dynamic_int8(model)
