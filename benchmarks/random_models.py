"""Random-weight models of real shapes, for timing where no real weights can travel (a lent GPU machine): Qwen2.5's,
and SmolLM2-135M's (llama architecture: the cross-family draft of the cross_vocab section), as transformers models and
as GGUF files for llama.cpp (written with the gguf package, quantized by llama.cpp's own quantize function). Costs
depend on shapes, not on weights, so these time what the real models would."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

# hidden, intermediate, layers, attention heads, KV heads, vocabulary, tied embeddings (Qwen2.5's configs, and
# SmolLM2-135M's).
SHAPES = {
    "tiny": (256, 512, 2, 4, 2, 1024, True),  # for checking scripts on a CPU (rows of 256: llama.cpp's k-quants)
    "tiny-draft": (256, 512, 1, 4, 2, 1024, True),
    "0.5B": (896, 4864, 24, 14, 2, 151936, True),
    "1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "7B": (3584, 18944, 28, 28, 4, 152064, False),
    "135M": (576, 1536, 30, 9, 3, 49152, True),  # SmolLM2-135M
    "tiny-llama": (256, 512, 1, 4, 2, 512, True),  # its stand-in on a CPU: another architecture and vocabulary
}
LLAMA = {"135M": 1e5, "tiny-llama": 1e5}  # the llama-architecture shapes (no attention biases), their RoPE base


def model_config(size: str):
    from transformers import LlamaConfig, Qwen2Config

    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[size]
    common = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, eos_token_id=None)
    if size in LLAMA:
        return LlamaConfig(max_position_embeddings=8192, rope_theta=LLAMA[size], rms_norm_eps=1e-5, **common)
    return Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, **common)


qwen_config = model_config  # the older name

@torch.no_grad()
def build_model(size: str, device="cpu", dtype=torch.bfloat16, seed: int = 0, copying: bool = False):
    """A Qwen2ForCausalLM (LlamaForCausalLM for a llama shape) of that shape with random weights, built directly in
    `dtype` on `device`.

    copying=True scales the embeddings up (and the output layer reads them back), so the greedy next token is the
    current one by a wide margin: a greedy continuation that half-precision rounding cannot flip between kernels of
    different shapes (a plain random model's top logits are close, so an n-token forward and n one-token forwards
    may pick different tokens in bf16 on a GPU, and a recorded continuation would stop being the target's). Same
    shapes, same work.
    """
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no float32 copy first: a 7B model is 30 GB in float32
    try:
        with torch.device(device):
            model = (LlamaForCausalLM if size in LLAMA else Qwen2ForCausalLM)(model_config(size)).eval()
    finally:
        torch.set_default_dtype(previous)
    if copying:
        embed = model.get_input_embeddings().weight
        # |e|^2 = 10^4 for every width: estimated from the weight scales, the current token's logit then beats the
        # best other one about 4x for the 0.5B and 1.5B shapes and 2x for the 7B one, whatever the layers add
        embed.mul_(5000.0 / embed.shape[1] ** 0.5)
        if not model.config.tie_word_embeddings:
            model.lm_head.weight.copy_(embed)
    return model


build_qwen = build_model  # the older name


def _gpt2_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet (bytes_to_unicode): the 256 one-byte tokens a byte-level BPE vocabulary has."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_gguf(size: str, path: Path, seed: int = 0) -> Path:
    """A random-weight GGUF of the shape (float16 matrices, float32 norms and biases), with a byte-level BPE
    vocabulary of the right size (the 256 byte tokens, one merge, filler tokens, an end-of-text token): qwen2's
    architecture, or llama's (no attention biases) for a llama shape."""
    import gguf

    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[size]
    llama = size in LLAMA
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 22, dtype=np.float32) * 0.02).astype(np.float16)  # reused: values don't time
    offset = [0]

    def matrix(rows: int, cols: int) -> np.ndarray:
        start = offset[0] = (offset[0] + 7919) % pool.size
        return np.resize(np.roll(pool, -start), (rows, cols))

    writer = gguf.GGUFWriter(str(path), "llama" if llama else "qwen2")
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(LLAMA[size] if llama else 1e6)
    if llama:
        writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5 if llama else 1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    alphabet = _gpt2_alphabet()
    tokens = alphabet + ["ĠĠ"] + [f"<|filler{i}|>" for i in range(vocab - len(alphabet) - 2)] + ["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm" if llama else "qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (vocab - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_eos_token_id(vocab - 1)
    writer.add_add_bos_token(False)
    ones = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", matrix(vocab, hidden))
    writer.add_tensor("output_norm.weight", ones)
    if not tied:
        writer.add_tensor("output.weight", matrix(vocab, hidden))
    for i in range(layers):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", ones)
        for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv * head_dim), ("attn_v", kv * head_dim)):
            writer.add_tensor(f"{blk}.{name}.weight", matrix(rows, hidden))
            if not llama:
                writer.add_tensor(f"{blk}.{name}.bias", matrix(1, rows)[0].astype(np.float32))
        writer.add_tensor(f"{blk}.attn_output.weight", matrix(hidden, heads * head_dim))
        writer.add_tensor(f"{blk}.ffn_norm.weight", ones)
        writer.add_tensor(f"{blk}.ffn_gate.weight", matrix(inter, hidden))
        writer.add_tensor(f"{blk}.ffn_up.weight", matrix(inter, hidden))
        writer.add_tensor(f"{blk}.ffn_down.weight", matrix(hidden, inter))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


write_qwen_gguf = write_gguf  # the older name


def quantize_gguf(source: Path, dest: Path, threads: int, ftype: str = "Q4_K_M") -> Path:
    """llama.cpp's own quantization (llama_model_quantize), as its llama-quantize tool runs it."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {dest}, {ftype}) returned {status}")
    return Path(dest)
