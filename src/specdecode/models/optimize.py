"""CPU speed transformations for the target and the draft model.

Two transformations, both working on any Hugging Face causal LM built from ``torch.nn.Linear`` layers
(Qwen2, Llama, ...), both CPU-only:

* :func:`prepack_linear_layers` -- for the **target** (and, identically, for the plain-decoding baseline).
  Replaces every fp32 ``nn.Linear`` by a oneDNN-prepacked linear. Outputs are the same function up to
  float rounding (max |d logit| ~ 4e-5 on Qwen2.5-Coder-1.5B, ~2e-6 relative; greedy tokens identical).
  Its point is that a forward of M = 2..5 new tokens costs about one 1-token forward (the default MKL
  path costs ~2x from M = 4 on), which is what speculative verification needs.
* :func:`quantize_dynamic_int8` -- for the **draft** only (it changes the draft's distribution, which
  only changes the acceptance rate, never the target's output distribution). int8 weights, int8
  dynamic activations (fbgemm / x86 kernels, weights prepacked).

Measurements (Qwen2.5-Coder 0.5B draft / 1.5B target, fp32, 2-vCPU shared VM, medians) are quoted in
each docstring; docs/BENCHMARKS.md has the commands that reproduce the end-to-end numbers.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn

__all__ = ["PrepackedLinear", "bf16_kernels_available", "prepack_linear_layers", "quantize_dynamic_int8"]

EXACT_ROWS = 16  # forwards of up to this many rows (decode steps, short verifications) run at their own width
BF16_NEEDS = ("oneDNN's bf16 kernels need a CPU with AVX-512 (avx512bw, avx512vl and avx512dq) or AVX-NE-CONVERT, "
              "and this CPU has neither")


def bf16_kernels_available() -> bool:
    """Whether oneDNN runs bf16 linears on this CPU: AVX-512 BW/VL/DQ or AVX-NE-CONVERT (as oneDNN itself decides,
    ONEDNN_MAX_CPU_ISA included). Asked the way torch's own mkldnn ops ask; where this torch build lacks that query,
    a 1x1 bf16 weight is packed to find out."""
    query = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if query is not None:
        return bool(query())
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(1, 1, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def _check_cpu_model(model: nn.Module, what: str) -> None:
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.device.type != "cpu":
            raise ValueError(
                f"{what} is a CPU-only transformation, but {name!r} is on {p.device}; "
                "move the model to the CPU first (model.to('cpu')) or skip this transformation."
            )


class PrepackedLinear(nn.Module):
    """A ``nn.Linear`` whose fp32 weight is stored in oneDNN's blocked ("prepacked") layout.

    ``forward`` calls ``torch.ops.mkldnn._linear_pointwise`` (the kernel inductor uses for frozen CPU
    linears). The original dense weight is not kept (no extra memory), so ``.weight`` does not exist:
    apply this after any weight tying / resizing / loading.
    """

    def __init__(self, linear: nn.Linear, batch_size_hint: int = 8, dtype: torch.dtype = torch.float32):
        super().__init__()
        w = linear.weight.detach()
        if w.dtype != torch.float32:
            raise ValueError(f"PrepackedLinear supports fp32 weights only, got {w.dtype}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"PrepackedLinear compute dtype must be float32 or bfloat16, got {dtype}")
        if dtype == torch.bfloat16 and not bf16_kernels_available():
            # oneDNN's own error names instruction sets only, from deep inside a reorder: say what to do instead
            raise RuntimeError(f"a bf16 prepacked draft cannot run here: {BF16_NEEDS}; use an fp32 draft "
                               f"(prepack_linear_layers(model)) or an int8 one (quantize_dynamic_int8)")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.batch_size_hint = batch_size_hint
        self.compute_dtype = dtype
        # An mkldnn (opaque) tensor; a plain attribute, not a buffer, so state_dict()/.to() leave it alone.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype).contiguous(), batch_size_hint)
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().to(dtype).clone(), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        rows = x.numel() // self.in_features
        width = padded_rows(rows)
        if width == rows:
            y = _pointwise(x.to(self.compute_dtype), self.packed_weight, self.bias)
        else:  # zero rows up to the width's bucket; the real rows' outputs are the same bit for bit
            flat = x.reshape(rows, self.in_features).to(self.compute_dtype)
            y = _pointwise(nn.functional.pad(flat, (0, 0, 0, width - rows)), self.packed_weight, self.bias)
            y = y[:rows].reshape(*x.shape[:-1], self.out_features)
        return y if y.dtype == in_dtype else y.to(in_dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, batch_size_hint={self.batch_size_hint}, compute_dtype={self.compute_dtype}"
        )


def padded_rows(rows: int) -> int:
    """The row count a prepacked forward of `rows` rows runs at: up to EXACT_ROWS as it is, beyond that rounded up
    to one of 8 widths per power of two (at most 1/8 more rows, 1/16 on average).

    Why: oneDNN builds a kernel for each (weight shape, row count) it sees and keeps it, in its primitive cache and
    in ideep's, ~0.3 MiB each there (~0.6 MiB a width per weight shape, measured on this torch's oneDNN 3.12),
    1024 entries each before anything is evicted. A server's forwards take every width (rows x tokens of decode
    steps, prefill chunks), so RSS grew by hundreds of MiB over a soak (issue 41); with buckets the kernels are
    ~48 per weight shape up to 256 rows. Exactness: a row's output does not depend on the other rows (the zero
    rows are sliced away); tests/test_prepack_widths.py checks it bit for bit."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)  # rows in [2^e, 2^(e+1)): steps of 2^(e-3)
    return -(-rows // step) * step


def _pointwise(x: torch.Tensor, weight, bias) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def prepack_linear_layers(
    model: nn.Module, batch_size_hint: int = 8, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Replace every fp32 ``nn.Linear`` of ``model`` (in place) by a oneDNN-prepacked :class:`PrepackedLinear`.

    What: each Linear's weight is reordered once into oneDNN's blocked layout for a batch of
    ``batch_size_hint`` rows (8 = the largest verification block we use; measured 4..64 are all
    equivalent, 1 is bad for M > 1); the dense weight is dropped. Embeddings, norms and attention are
    untouched; a tied ``lm_head`` gets its own packed copy (the embedding keeps the original weight,
    so the model keeps working, at the cost of one extra vocab x hidden matrix in memory).

    When it helps (Qwen2.5-Coder-1.5B fp32, warm cache of 100 tokens, 1 thread, medians on a noisy
    shared 2-vCPU VM, cost relative to a 1-token forward): default path M=2,3 ~0.6-1.2x (noise),
    M=4,5 ~1.2x, M=8 ~1.6x; prepacked M=2..5 0.84-1.03x, M=8 1.12x. Per Linear (1536x8960, 1 thread):
    default M=1..3 flat, M=4/5 2x, M=8 3x; prepacked M=1 1.05x of default, flat to M=5, M=8 1.8x.
    In a greedy 64-token loop the prepacked target alone was 1.17x the default (noise-level). So it makes
    a K+1 = 3..6 token verification nearly as cheap as one decode step. Use it for the target of
    speculative decoding, and for the plain baseline too (it does not slow 1-token decoding).

    Exactness: NOT bit-identical to ``F.linear`` (different summation order), but the same function
    up to fp32 rounding: max |d logit| ~ 4e-5 (~2e-6 relative) on the 1.5B; greedy output identical
    on 100 tokens of code. The model stays fp32.

    ``dtype=torch.bfloat16`` (DRAFT ONLY -- it changes the outputs): weights packed in bf16, activations
    cast to bf16 per Linear and the result cast back (the rest of the model stays fp32). Fast only on
    CPUs with native bf16 (AVX512-BF16 / AMX; ``torch.backends.mkldnn`` uses them through oneDNN);
    on other AVX-512 CPUs oneDNN emulates bf16 and it can be slower than fp32, and on CPUs without AVX-512
    BW/VL/DQ or AVX-NE-CONVERT (AVX2-only) oneDNN has no bf16 linear at all (see bf16_kernels_available).

    Raises ``ValueError`` for a model not on the CPU or with non-fp32 Linear weights, and
    ``RuntimeError`` where this torch build has no oneDNN (mkldnn), or for bf16 on a CPU without bf16 kernels
    (before any layer is replaced).
    """
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("prepack_linear_layers needs a torch build with oneDNN (torch.backends.mkldnn)")
    _check_cpu_model(model, "prepack_linear_layers")
    targets = []
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if type(child) is nn.Linear:  # exact type: leave quantized / custom Linear subclasses alone
                if child.weight.dtype != torch.float32:
                    raise ValueError(
                        f"prepack_linear_layers supports fp32 models only; {child_name} has {child.weight.dtype}"
                    )
                targets.append((parent, child_name, child))
    packed = {}
    for parent, child_name, child in targets:
        key = id(child)  # a Linear shared by two parents is packed once
        if key not in packed:
            packed[key] = PrepackedLinear(child, batch_size_hint, dtype)
        setattr(parent, child_name, packed[key])
    return model


def quantize_dynamic_int8(model: nn.Module, inplace: bool = False) -> nn.Module:
    """Quantize every ``nn.Linear`` to int8 weights with dynamic int8 activations (for a DRAFT model).

    What: ``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)`` -- per-tensor
    int8 weights (prepacked for fbgemm/x86), activations quantized per call. Embeddings are untouched,
    so a tied lm_head/embedding keeps working (the lm_head gets an int8 copy, the embedding stays fp32).
    Returns a new model unless ``inplace=True``.

    When it helps: Qwen2.5-Coder-0.5B draft, 1 thread: 1-token step 140 ms vs 358 ms fp32 (0.39x),
    2-4 tokens 1.1-1.2x of that. Teacher-forced greedy agreement with the 1.5B fp32 target on 100 code
    tokens: 0.72 (fp32 draft 0.90); in a K=3 speculative loop acceptance 0.77 vs 0.79 for a bf16 draft,
    and the cheaper draft won (3.4x vs 2.7x the default plain loop in that noisy run). Only for drafts: it changes
    the model's outputs (int8 rounding), so never apply it to the target. The speculative output
    distribution is unaffected (only the acceptance rate changes).

    ``torch.ao.quantization`` is deprecated in favour of torchao; the warning is silenced here. Raises
    ``ValueError`` for a model not on the CPU.
    """
    _check_cpu_model(model, "quantize_dynamic_int8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=inplace)
