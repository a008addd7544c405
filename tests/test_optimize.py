"""specdecode.models.optimize on a tiny random Qwen2: prepacked target == original (within 1e-4) with a KV cache,
int8 draft runs, tied embeddings survive, and unsupported inputs fail clearly."""

from __future__ import annotations

import copy
import os
import platform
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from specdecode.backends.hf import cache_keyword
from specdecode.models import optimize
from specdecode.models.optimize import (BF16_NEEDS, PrepackedLinear, bf16_kernels_available, prepack_linear_layers,
                                        quantize_dynamic_int8)


def tiny_qwen2(tie: bool = False, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return Qwen2ForCausalLM(cfg).eval()


@torch.inference_mode()
def logits_with_cache(model, prompt, new):
    cache = {cache_keyword(model.forward): DynamicCache(config=model.config)}
    model(prompt, use_cache=True, **cache)
    return model(new, use_cache=True, **cache).logits


@pytest.mark.parametrize("tie", [False, True])
def test_prepacked_matches_original_with_cache(tie):
    ref_model = tiny_qwen2(tie=tie)
    model = prepack_linear_layers(copy.deepcopy(ref_model))
    assert any(isinstance(m, PrepackedLinear) for m in model.modules())
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (1, 11), generator=g)
    for m in range(1, 9):
        new = torch.randint(0, 64, (1, m), generator=g)
        ref = logits_with_cache(ref_model, prompt, new)
        out = logits_with_cache(model, prompt, new)
        assert out.shape == ref.shape == (1, m, 64)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_prepack_keeps_tied_embedding():
    ref_model = tiny_qwen2(tie=True)
    emb = ref_model.get_input_embeddings().weight.detach().clone()
    model = prepack_linear_layers(copy.deepcopy(ref_model))
    torch.testing.assert_close(model.get_input_embeddings().weight, emb, atol=0, rtol=0)


def test_int8_draft_runs():
    model = quantize_dynamic_int8(tiny_qwen2())
    prompt = torch.randint(0, 64, (1, 7))
    for m in (1, 2, 5):
        out = logits_with_cache(model, prompt, torch.randint(0, 64, (1, m)))
        assert out.shape == (1, m, 64)
        assert torch.isfinite(out).all()


def test_int8_tied_draft_runs_and_does_not_touch_original():
    orig = tiny_qwen2(tie=True)
    model = quantize_dynamic_int8(orig)
    assert type(orig.lm_head) is torch.nn.Linear  # not in place by default
    out = logits_with_cache(model, torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 3)))
    assert out.shape == (1, 3, 64) and torch.isfinite(out).all()


def test_unsupported_inputs_fail_clearly():
    with pytest.raises(ValueError, match="fp32"):
        prepack_linear_layers(tiny_qwen2().to(torch.bfloat16))
    meta = tiny_qwen2().to("meta")
    with pytest.raises(ValueError, match="CPU"):
        prepack_linear_layers(meta)
    with pytest.raises(ValueError, match="CPU"):
        quantize_dynamic_int8(meta)


@pytest.mark.skipif(not bf16_kernels_available(), reason=f"no bf16 prepacked draft on this CPU: {BF16_NEEDS}")
def test_bf16_prepacked_draft_runs_close_to_fp32():
    ref_model = tiny_qwen2()
    model = prepack_linear_layers(copy.deepcopy(ref_model), dtype=torch.bfloat16)
    prompt, new = torch.randint(0, 64, (1, 6)), torch.randint(0, 64, (1, 3))
    out = logits_with_cache(model, prompt, new)
    ref = logits_with_cache(ref_model, prompt, new)
    assert out.shape == (1, 3, 64) and out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)  # bf16 rounding: draft-only transform


def test_bf16_without_the_instruction_sets_fails_in_one_clear_line(monkeypatch):
    """On a CPU without oneDNN's bf16 kernels (mocked here, so this runs on every CPU): one error naming the
    instruction sets and the way out, raised before any layer is replaced."""
    monkeypatch.setattr(optimize, "bf16_kernels_available", lambda: False)
    model = tiny_qwen2()
    with pytest.raises(RuntimeError) as error:
        prepack_linear_layers(model, dtype=torch.bfloat16)
    message = str(error.value)
    assert "\n" not in message and "avx512bw, avx512vl and avx512dq" in message and "AVX-NE-CONVERT" in message
    assert "use an fp32 draft" in message and "int8" in message
    assert not any(isinstance(m, PrepackedLinear) for m in model.modules())
    prepack_linear_layers(model)  # fp32 needs no such instruction set


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="ONEDNN_MAX_CPU_ISA is x86's")
def test_the_bf16_check_agrees_with_onednn():
    """With oneDNN held to AVX2 (what an AVX2-only CPU offers) the check says no and prepacking fails with the
    clear line, where oneDNN itself would have raised from inside a reorder."""
    script = ("import torch\n"
              "from specdecode.models.optimize import bf16_kernels_available, prepack_linear_layers\n"
              "print(bf16_kernels_available())\n"
              "try:\n"
              "    prepack_linear_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)), dtype=torch.bfloat16)\n"
              "except RuntimeError as e:\n"
              "    print(e)\n")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    lines = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert lines[0] == "False" and lines[1].startswith("a bf16 prepacked draft cannot run here")
