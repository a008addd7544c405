"""Loading a model and its tokenizer, offline: a built-in name, a local HF directory, a .gguf file, or a hub id
already in the local Hugging Face cache. Nothing is ever downloaded, no pickled weights and no remote code are
loaded unless asked for."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
QUANTIZE = ("int8", "int4")


class ModelNotFoundError(FileNotFoundError):
    pass


class DeviceUnavailableError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer; the generators accept it wherever they accept a model."""

    model: torch.nn.Module
    tokenizer: object | None
    name: str
    path: str


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


def _locate(name_or_path: str, progress: bool) -> tuple[str, dict]:
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
        return str(registry.prepare_model(name_or_path, progress=progress)), {}
    if "/" in name_or_path and not name_or_path.startswith((".", "/", "~")):
        return name_or_path, {"local_files_only": True}
    known = ", ".join(m.name for m in registry.list_models())
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found: it is not a built-in name ({known}), not a local directory or .gguf "
        f"file, and not a hub id (org/name). Nothing is downloaded at run time.")


def load_model(name_or_path, device: str = "cpu", dtype="auto", trust_remote_code: bool = False,
               device_map: str | None = None, quantize: str | None = None, prepack: bool = False,
               progress: bool = True) -> LoadedModel:
    """Load a causal LM and its tokenizer offline.

    name_or_path: a built-in name (see `specdecode models list`), a local HF directory, a .gguf file, or a hub
    id already in the local HF cache; a transformers model passes through. quantize: "int8" (CPU: torch's
    dynamic int8 Linear layers; CUDA: bitsandbytes) or "int4" (CUDA, bitsandbytes). Quantizing only the draft
    keeps the output exactly the target's distribution. prepack: on the CPU, store fp32 Linear weights in
    oneDNN's blocked layout, which makes a forward of a few tokens (speculative verification) cost about one
    decode step; the same function up to fp32 rounding (see models/optimize.py). Ignored off the CPU, for
    quantized models, and for non-fp32 models.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    if isinstance(name_or_path, PreTrainedModel):
        return LoadedModel(name_or_path, None, type(name_or_path).__name__, "")
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
    return LoadedModel(model, tokenizer, str(name_or_path), source)


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
