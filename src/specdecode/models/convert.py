"""Converting a GGUF into a plain Hugging Face directory (safetensors + tokenizer + config), checked against the GGUF.

The transformers path of a built-in model (models/prepare.py's prepare_model) loads the converted copy: seconds,
instead of the minute a GGUF dequantization costs. Progress goes to a ``progress(description, done, total)``
callback, as in prepare.py; this module draws nothing.
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import Callable, Iterator, Union

# Text used to compare the GGUF-loaded model with the reloaded safetensors copy.
PROBE_TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)  # héllo 世界"

ProgressArg = Union[Callable[[str, int, int], None], bool, None]


class ConversionError(RuntimeError):
    """The converted Hugging Face directory does not reproduce the GGUF model."""


def _silent(description: str, done: int, total: int) -> None:
    pass


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    # transformers' own bars would tear the caller's display: off with its own switch. Its GGUF dequantization bar
    # is a plain tqdm that this switch does not reach; the CLI turns every tqdm off with tqdm's TQDM_DISABLE.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()



def check_safetensors(path: Path) -> None:
    # safe_open validates that the header's offsets fit the file, which catches truncated writes.
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if not list(f.keys()):
                raise ValueError("no tensors")
    except Exception as exc:
        raise ConversionError(f"{path} is not a valid safetensors file ({exc}); delete it and re-run "
                              f"prepare_model") from exc


def save_hf_dir(model, tokenizer, out_dir: Path) -> Path:
    """Write ``model`` and ``tokenizer`` as a plain Hugging Face directory with safetensors.

    ``model.save_pretrained`` refuses GGUF-loaded models ("quantized with gguf and is not
    serializable") even though their weights are already plain float tensors, so the pieces
    are saved one by one and the GGUF quantization_config is dropped from the config.
    """
    from safetensors.torch import save_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    # save_model (unlike save_file) drops the duplicate of tied weights such as lm_head.
    save_model(model, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _probe_ids(tokenizer, vocab_size: int) -> list[int]:
    ids = [i for i in tokenizer(PROBE_TEXT)["input_ids"] if i < vocab_size][:32]
    return ids or [0]


def _logits(model, ids: list[int]):
    import torch

    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def verify_hf_dir(out_dir: Path, ids: list[int], expected_logits, expected_ids: list[int] | None = None,
                  atol: float = 1e-4) -> None:
    """Reload ``out_dir`` and check it reproduces ``expected_logits`` on ``ids``.

    ``expected_ids`` (the original tokenizer's encoding of PROBE_TEXT) also checks the saved
    tokenizer. Raises ConversionError on any difference.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if expected_ids is not None:
        got_ids = tokenizer(PROBE_TEXT)["input_ids"]
        if got_ids != expected_ids:
            raise ConversionError(f"the saved tokenizer in {out_dir} encodes differently: {got_ids} != "
                                  f"{expected_ids}")
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    model.eval()
    logits = _logits(model, ids)
    del model
    if logits.shape != expected_logits.shape:
        raise ConversionError(f"reloaded model in {out_dir} gives logits of shape {tuple(logits.shape)}, expected "
                              f"{tuple(expected_logits.shape)}")
    diff = (logits - expected_logits).abs().max().item()
    if not diff <= atol:
        raise ConversionError(f"reloaded model in {out_dir} differs from the original: max |logit diff| = "
                              f"{diff:.3g} > {atol}")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: ProgressArg = None) -> Path:
    """Dequantize a GGUF file into a float32 Hugging Face directory and verify the result.

    Peak memory is about the float32 model plus the GGUF (about 9 GB for the 1.5B); the
    original model is freed before the saved copy is reloaded for verification.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    report = progress if callable(progress) else _silent

    def step(done: int, what: str) -> None:
        report(f"converting {gguf_path.name}: {what}", done, 4)

    with quiet_transformers():
        step(0, "loading GGUF (dequantizing)")
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model.eval()
        step(1, "computing reference logits")
        ids = _probe_ids(tokenizer, model.config.get_text_config().vocab_size)
        expected = _logits(model, ids)
        step(2, "saving safetensors")
        save_hf_dir(model, tokenizer, out_dir)
        expected_ids = tokenizer(PROBE_TEXT)["input_ids"]
        del model, tokenizer
        gc.collect()
        step(3, "verifying reload")
        verify_hf_dir(out_dir, ids, expected, expected_ids)
        step(4, "verified")
    return Path(out_dir)
