"""Where a model comes from (a built-in name, a local HF directory, a .gguf file, a hub id already in the local
Hugging Face cache) and how transformers loads it (from_pretrained, then quantized or prepacked): what every backend's
loader is built on. Nothing here imports a backend: backends import this, and specdecode/loading.py (load_model,
which picks a backend) imports both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import OptionError
from .prepare import Progress, prepare_model

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
QUANTIZE = ("int8", "int4")


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
        raise OptionError("device", f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype, device: torch.device):
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        # fp32 on CPU: this CPU class has no bf16 arithmetic, and half precision is slower there.
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise OptionError("dtype", f"dtype must be float32, float16, bfloat16 or auto, got {dtype!r}")
    return DTYPES[dtype]


def locate(name_or_path: str, progress: Progress | bool | None = None) -> tuple[str, dict]:
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
    from . import catalog

    if catalog.is_registered(name_or_path):
        return str(prepare_model(name_or_path, progress=progress)), {}
    if "/" in name_or_path and not name_or_path.startswith((".", "/", "~")):
        return name_or_path, {"local_files_only": True}
    known = ", ".join(m.name for m in catalog.list_models())
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found: it is not a built-in name ({known}), not a local directory or .gguf "
        f"file, and not a hub id (org/name). Nothing is downloaded at run time.")


@dataclass(frozen=True)
class LoadOptions:
    """How load_model was asked to load, as every backend's loader takes it; checked here, once.

    A backend reads what applies to it and ignores the rest (see load_model for each field).
    """

    device: str = "cpu"
    dtype: Any = "auto"
    trust_remote_code: bool = False
    device_map: str | None = None
    quantize: str | None = None
    prepack: bool = False
    progress: Progress | bool | None = None
    threads: int | None = None
    backend_options: dict | None = None
    exact_greedy: bool = False
    max_rows: int | None = None
    token_trees: bool = False
    huge_pages: bool = True
    lean_gguf: bool = False

    def __post_init__(self):
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise OptionError("threads", f"threads must be an integer >= 1, got {self.threads!r}")
        if self.quantize not in (None, *QUANTIZE):
            raise OptionError("quantize", f"unknown quantization {self.quantize!r}: use int8 or int4")
        if self.device_map is None:
            resolve_dtype(self.dtype, resolve_device(self.device))
        else:
            _require_accelerate_gpu(self.device_map)
            resolve_dtype(self.dtype, torch.device("cuda"))

    @property
    def on_cpu(self) -> bool:
        return self.device_map is None and resolve_device(self.device).type == "cpu"


def load_transformers(source, options: LoadOptions) -> LoadedModel:
    """The model as transformers loads it (from_pretrained, then quantized or prepacked); a transformers model
    object passes through. What the transformers and static backends are built on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    if isinstance(source, PreTrainedModel):
        return LoadedModel(source, None, type(source).__name__, "")
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    target_device = resolve_device(options.device) if options.device_map is None else None
    torch_dtype = resolve_dtype(options.dtype,
                                target_device or torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    location, extra = locate(str(source), options.progress)
    kwargs = dict(extra, dtype=torch_dtype, trust_remote_code=options.trust_remote_code)
    if "gguf_file" not in extra:
        kwargs["use_safetensors"] = True  # never unpickle weights
    on_cuda = options.device_map is not None or target_device.type == "cuda"
    quantize = options.quantize
    if quantize and on_cuda:
        kwargs["quantization_config"] = _bitsandbytes_config(quantize)
    if options.device_map is not None:
        kwargs["device_map"] = options.device_map
    model = _from_pretrained(AutoModelForCausalLM, location, extra, kwargs)
    if options.device_map is None and not (quantize and on_cuda):
        model = model.to(target_device)
    model.eval()
    if quantize and not on_cuda:
        model = _quantize_cpu(model, quantize)
    elif options.prepack and not on_cuda and torch_dtype == torch.float32 and torch.backends.mkldnn.is_available():
        from .optimize import prepack_linear_layers

        model = prepack_linear_layers(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=options.trust_remote_code, **extra)
    except (OSError, ValueError):
        tokenizer = None  # token ids in, token ids out
    return LoadedModel(model, tokenizer, str(source), location)


def _from_pretrained(auto_class, location: str, extra: dict, kwargs: dict):
    try:
        return auto_class.from_pretrained(location, **kwargs)
    except OSError as err:
        if extra.get("local_files_only"):
            raise ModelNotFoundError(
                f"{location!r} is not in the local Hugging Face cache and nothing is downloaded at run time: "
                f"download it beforehand, or give a local directory or .gguf file ({err})") from None
        if "safetensors" in str(err) or "pytorch_model.bin" in str(err):
            raise ModelNotFoundError(
                f"{location} has no safetensors weights; pickled weights (pytorch_model.bin) are not loaded because "
                f"unpickling can run arbitrary code: convert the checkpoint to safetensors first") from None
        raise


def is_gguf(name_or_path: str) -> bool:
    """A .gguf file, or a built-in name (every built-in model is a GGUF) that is not also a local path."""
    from . import catalog

    path = Path(os.path.expanduser(name_or_path))
    if path.exists():
        return path.is_file() and path.suffix == ".gguf"
    if not catalog.is_registered(name_or_path):
        return False
    # a built-in whose packages are gone but whose converted directory is cached stays on transformers
    return catalog.get_model_info(name_or_path).installed or catalog.gguf_cache_path(name_or_path).exists()


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
