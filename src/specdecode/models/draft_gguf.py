"""Cheaper drafts, made once from a draft GGUF file: a shorter output layer, fewer layers.

The draft only proposes; the target's rejection sampler keeps the output exact whatever q is. So a draft may be
made cheaper freely, and only its acceptance rate pays. Two cuts, written as a new GGUF with the `gguf` package:
- vocab_limit=N keeps the first N token rows of the embedding and output layers (FR-Spec, Zhao et al. 2025: the
  output layer is a third of a 0.5B model's bytes per step). Byte-level BPE ids are ordered by merge rank, which
  follows corpus frequency, so the first N ids are the frequent ones. The draft then puts q = 0 on the other ids
  (it never proposes them), and the llama.cpp backend maps an id >= N in its input to a fallback id.
- keep_layers keeps only these transformer blocks (layer skipping), renumbered in order.
"""

from __future__ import annotations

from pathlib import Path

_TOKEN_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
_VOCAB_TENSORS = ("token_embd.weight", "output.weight")


def shrink_draft_gguf(source: str | Path, dest: str | Path, vocab_limit: int | None = None,
                      keep_layers: list[int] | None = None, token_order: list[int] | None = None) -> Path:
    """Write a cheaper draft. token_order (optional): the model's token ids, most useful first; the draft's id i
    is then token_order[i] of the original vocabulary (the backend maps ids both ways), so vocab_limit keeps the
    most frequent tokens rather than the lowest ids."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    n_layers = reader.fields[f"{arch}.block_count"].contents()
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    limit = n_vocab if vocab_limit is None else int(vocab_limit)
    if not 1 <= limit <= n_vocab:
        raise ValueError(f"vocab_limit must be in 1..{n_vocab} (the model's vocabulary), got {vocab_limit}")
    layers = list(range(n_layers)) if keep_layers is None else sorted(set(keep_layers))
    if not layers or layers[0] < 0 or layers[-1] >= n_layers:
        raise ValueError(f"keep_layers must name layers in 0..{n_layers - 1}, got {keep_layers}")
    renumber = {old: new for new, old in enumerate(layers)}
    order = list(range(n_vocab)) if token_order is None else _full_order(token_order, n_vocab)
    kept = np.array(order[:limit])
    new_id = {old: new for new, old in enumerate(order[:limit])}

    writer = gguf.GGUFWriter(str(dest), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name in _TOKEN_ARRAYS:
            value = [value[i] for i in kept]
        elif field.name == f"{arch}.block_count":
            value = len(layers)
        elif field.name.endswith("_token_id") and isinstance(value, int):
            if value not in new_id:
                continue  # a special token the short vocabulary no longer has
            value = new_id[value]
        writer.add_key_value(field.name, value, kind, sub_type=sub)

    tensors = []
    for tensor in reader.tensors:
        name, data = tensor.name, tensor.data
        if name.startswith("blk."):
            index = int(name.split(".")[1])
            if index not in renumber:
                continue
            name = f"blk.{renumber[index]}." + name.split(".", 2)[2]
        elif name in _VOCAB_TENSORS:
            data = data[kept] if token_order is not None else data[:limit]
        tensors.append((name, data, tensor.tensor_type))
    for name, data, kind in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return Path(dest)


def _full_order(token_order: list[int], n_vocab: int) -> list[int]:
    """token_order first (deduplicated, in range), then every other id in id order."""
    seen, order = set(), []
    for t in list(token_order) + list(range(n_vocab)):
        if 0 <= t < n_vocab and t not in seen:
            seen.add(t)
            order.append(t)
    return order
