"""A transformers causal LM behind the backend interface, with a DynamicCache that can forget tokens.

Rows of a batch grow by different amounts (each row accepts its own number of drafts), but a DynamicCache
is one rectangular tensor per layer. So the cache is a sequence of slots shared by all rows, and a boolean
slot mask says which slots hold a row's real tokens: left padding, and tokens a row rejected while another
row kept its own, are holes that attention never sees. Positions come from each row's count of real tokens,
so a hole changes nothing in what the model computes. Trailing slots that no row needs are cropped. A batch of
one never has holes and runs with no mask at all.

Sliding-window attention is the exception: transformers measures the window in slots, so a hole inside the
window would shift it. For those models the cache is compacted (each row's real tokens gathered to the right,
left padding before them) before any forward that follows a hole.
"""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import DynamicCache

from ..exact.token_tree import ancestors_mask, depths
from ..text.vocab import embedding_rows, token_ids
from . import register_backend


def cache_keyword(forward) -> str:
    """The name under which a model's `forward` (and its `generate`) takes the KV cache: transformers 5.x renamed
    `past_key_values` to `cache` and will remove the old name, but earlier 5.x releases know only the old one."""
    params = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    # A wrapper that hides the signature (*args, **kwargs): the name this release gives its own models.
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


class HFBackend:
    def __init__(self, model, vocab_size: int | None = None):
        self.model = model.eval()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.vocab_size = vocab_size or embedding_rows(model)
        self.device = next(model.parameters()).device
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.eos_token_ids = _eos_ids(model)
        self.name = getattr(config, "_name_or_path", "") or type(model).__name__
        params = inspect.signature(model.forward).parameters
        self._takes_positions = "position_ids" in params
        self._takes_logits_to_keep = "logits_to_keep" in params
        self._cache_keyword = cache_keyword(model.forward)
        layer_types = getattr(config, "layer_types", None) or []
        self._sliding = "sliding_attention" in layer_types or (
            not layer_types and getattr(config, "sliding_window", None) is not None
            and getattr(config, "use_sliding_window", True))
        self.reset(1)

    @property
    def lengths(self) -> list[int]:
        return list(self._lengths)

    def reset(self, batch_size: int) -> None:
        # Full layers even for sliding-window models: a sliding layer forgets old slots on its own, and then a
        # rejected draft could no longer be cropped.
        self.cache = DynamicCache()
        self.mask: torch.Tensor | None = None  # [B, slots] bool, or None when every slot is real
        self._lengths = [0] * batch_size
        self._slots = 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, last_only: bool = False,
                output_hidden: bool = False):
        batch, n = input_ids.shape
        if self._sliding and self.mask is not None:
            self._compact()
        past = torch.tensor(self._lengths, device=self.device).unsqueeze(1)
        if valid is None:
            positions = past + torch.arange(n, device=self.device)
            new_counts = [n] * batch
        else:
            positions = (past + valid.long().cumsum(dim=1) - 1).clamp(min=0)
            new_counts = valid.sum(dim=1).tolist()
        if self.mask is not None or valid is not None:
            old = self.mask if self.mask is not None else torch.ones(batch, self._slots, dtype=torch.bool,
                                                                     device=self.device)
            new = valid if valid is not None else torch.ones(batch, n, dtype=torch.bool, device=self.device)
            self.mask = torch.cat([old, new.bool()], dim=1)
        kwargs = {"input_ids": input_ids, self._cache_keyword: self.cache, "use_cache": True}
        if self.mask is not None:
            kwargs["attention_mask"] = self.mask.long()
        if self._takes_positions:
            kwargs["position_ids"] = positions
        ragged_end = valid is not None and not bool(valid[:, -1].all())
        if last_only and self._takes_logits_to_keep and not ragged_end:
            kwargs["logits_to_keep"] = 1
        if output_hidden:
            kwargs["output_hidden_states"] = True
        out = self.model(**kwargs)
        logits = out.logits
        if last_only and ragged_end:  # right-padded rows: each row's last real token
            last = (valid.long() * torch.arange(1, n + 1, device=self.device)).argmax(dim=1)
            logits = logits[torch.arange(batch, device=self.device), last].unsqueeze(1)
        elif last_only:
            logits = logits[:, -1:]
        self._slots += n
        self._lengths = [a + b for a, b in zip(self._lengths, new_counts)]
        logits = logits[..., : self.vocab_size].float()
        return (logits, out.hidden_states[-1]) if output_hidden else logits

    def trim(self, lengths: list[int]) -> None:
        if list(lengths) == self._lengths:
            return
        if self.mask is None and len(set(lengths)) == 1:
            self._crop_to(lengths[0])
        else:
            mask = self.mask if self.mask is not None else torch.ones(
                len(lengths), self._slots, dtype=torch.bool, device=self.device)
            keep = torch.tensor(lengths, device=self.device).unsqueeze(1)
            self.mask = mask & (mask.long().cumsum(dim=1) <= keep)
            self._drop_trailing_holes()
        self._lengths = list(lengths)

    # ------------------------------------------------------------------ token trees (token_tree.py)
    @property
    def supports_trees(self) -> bool:
        """A tree step needs a custom 4D mask, which replaces transformers' own mask: not for sliding windows."""
        return not self._sliding

    @torch.inference_mode()
    def forward_tree(self, input_ids: torch.Tensor, parents: list[list[int]]) -> torch.Tensor:
        """Logits [B, N+1, V] of a tree step: input_ids [B, N+1] are each row's last token (the root) and its N
        nodes, parents[b] their tree (token_tree.py). Each node sits at the position of its depth and attends to
        the row's cache and its own ancestors only (a 4D mask). Every new slot is held until keep_paths."""
        batch, n = input_ids.shape
        if not self.supports_trees:
            raise ValueError(f"{self.name}: token trees are not supported with sliding-window attention")
        past = torch.tensor(self._lengths, device=self.device).unsqueeze(1)
        depth = torch.tensor([[0] + depths(list(par)) for par in parents], device=self.device)
        old = self.mask if self.mask is not None else torch.ones(batch, self._slots, dtype=torch.bool,
                                                                 device=self.device)
        tree = torch.stack([ancestors_mask(list(par)) for par in parents]).to(self.device)
        allowed = torch.cat([old.unsqueeze(1).expand(-1, n, -1), tree], dim=2)
        dtype = next(self.model.parameters()).dtype
        bias = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(~allowed,
                                                                                         torch.finfo(dtype).min)
        kwargs = {"input_ids": input_ids, self._cache_keyword: self.cache, "use_cache": True,
                  "attention_mask": bias.unsqueeze(1)}
        if self._takes_positions:
            kwargs["position_ids"] = past + depth
        logits = self.model(**kwargs).logits
        self._tree_start = self._slots
        self.mask = torch.cat([old, torch.ones(batch, n, dtype=torch.bool, device=self.device)], dim=1)
        self._slots += n
        self._lengths = [length + n for length in self._lengths]
        return logits[..., : self.vocab_size].float()

    def keep_paths(self, paths: list[list[int]]) -> None:
        """After forward_tree: row b keeps its root and the nodes of paths[b] (in order); the other nodes' slots
        become holes, which attention never sees and positions do not count."""
        start, n = self._tree_start, self._slots - self._tree_start
        keep = torch.zeros(len(paths), n, dtype=torch.bool, device=self.device)
        keep[:, 0] = True
        for b, path in enumerate(paths):
            keep[b, [i + 1 for i in path]] = True
        self.mask = torch.cat([self.mask[:, :start], keep], dim=1)
        self._lengths = [length - n + 1 + len(path) for length, path in zip(self._lengths, paths)]
        self._drop_trailing_holes()

    def fork(self, batch_size: int) -> "HFBackend":
        other = copy.copy(self)  # shares the model; reset() gives it a cache of its own
        other.reset(batch_size)
        return other

    def merge(self, other: "HFBackend") -> None:
        """Rows of other join this batch; the shorter cache is left-padded with masked slots to align them."""
        if not other._lengths:
            return
        if not self._lengths:
            self.cache, self.mask, self._lengths, self._slots = other.cache, other.mask, list(other._lengths), other._slots
            return
        width = max(self._slots, other._slots)
        if not width:  # nothing cached on either side: the next forward makes the merged batch's rows
            self.cache = DynamicCache()
        else:
            if not self._slots:  # rows with nothing cached yet (a lazily prefilled draft): all slots are holes
                self.cache = other.cache.__class__()
                self.cache.layers = [_empty_like(layer, len(self._lengths)) for layer in other.cache.layers]
            mine_layers = self.cache.layers
            theirs_layers = other.cache.layers if other._slots else [
                _empty_like(layer, len(other._lengths)) for layer in mine_layers]
            for mine, theirs in zip(mine_layers, theirs_layers):
                mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
                mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self.mask = torch.cat([_left_pad_mask(self.mask, len(self._lengths), self._slots, width, self.device),
                               _left_pad_mask(other.mask, len(other._lengths), other._slots, width, self.device)])
        self._lengths += other._lengths
        self._slots = width
        if bool(self.mask.all()):
            self.mask = None

    def select_rows(self, rows: list[int]) -> None:
        if rows == list(range(len(self._lengths))):
            return
        if not rows:
            self.reset(0)
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self._lengths = [self._lengths[r] for r in rows]
        if self.mask is not None:
            self.mask = self.mask[index]
            self._drop_trailing_holes()

    # ------------------------------------------------------------------ prefix caching (prefix_cache.py)
    def free_rows(self) -> int:
        return 1 << 30  # no fixed number of rows: a parked prefix is a tensor copy of its own

    def park(self, rows: list[int]) -> list["_RowKV"]:
        """Drop these rows from the batch, keeping a copy of their KV for the prefix cache."""
        handles = [self.kv_ref(r) for r in rows]
        gone = set(rows)
        self.select_rows([r for r in range(len(self._lengths)) if r not in gone])
        return handles

    def kv_ref(self, row: int) -> "_RowKV":
        """A copy of a row's real slots, layer by layer ([heads, tokens, dim])."""
        real = self.mask[row] if self.mask is not None else None
        keys, values = [], []
        for layer in self.cache.layers if self._lengths[row] else []:
            k, v = layer.keys[row], layer.values[row]
            keys.append((k[:, real] if real is not None else k).clone())
            values.append((v[:, real] if real is not None else v).clone())
        return _RowKV(keys, values, self._lengths[row])

    def load_prefixes(self, prefixes: list) -> None:
        """On a fresh fork: row b starts from the first n cached tokens of its handle (right-aligned, holes before)."""
        if any(self._lengths):
            raise ValueError("load_prefixes needs a fresh fork")
        counts = [item[1] if item is not None else 0 for item in prefixes]
        if not any(counts):
            return
        width = max(counts)
        first = next(h for h in prefixes if h is not None)[0]
        for layer_index, (k0, v0) in enumerate(zip(first.keys, first.values)):
            keys = k0.new_zeros(len(prefixes), k0.shape[0], width, k0.shape[2])
            values = v0.new_zeros(len(prefixes), v0.shape[0], width, v0.shape[2])
            for b, item in enumerate(prefixes):
                if item is not None:
                    handle, n = item
                    keys[b, :, width - n:] = handle.keys[layer_index][:, :n]
                    values[b, :, width - n:] = handle.values[layer_index][:, :n]
            self.cache.update(keys, values, layer_index)
        slots = torch.arange(width, device=self.device)
        self.mask = slots.unsqueeze(0) >= width - torch.tensor(counts, device=self.device).unsqueeze(1)
        self._lengths, self._slots = counts, width
        if bool(self.mask.all()):
            self.mask = None

    def _compact(self) -> None:
        """Gather each row's real slots to the right end, so that no hole sits inside an attention window."""
        mask = self.mask
        if not bool((mask[:, 1:] < mask[:, :-1]).any()):  # already left padding only
            return
        width = max(self._lengths)
        slots = torch.arange(self._slots, device=self.device).expand_as(mask)
        # stable order: real slots last, in their original order
        order = torch.argsort(mask.long() * (self._slots + 1) + slots, dim=1)[:, -width:]
        for layer in self.cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
        self.mask = mask.gather(1, order)
        self._slots = width

    def _drop_trailing_holes(self) -> None:
        used = self.mask.any(dim=0).nonzero()
        self._crop_to(int(used[-1]) + 1 if len(used) else 0)
        if bool(self.mask.all()):
            self.mask = None

    def _crop_to(self, slots: int) -> None:
        if slots == 0:
            # No slot left: a new cache, whose rows the next forward makes. transformers' layers ignore a row
            # selection while they hold no slot (batch_select_indices), so an emptied cache would keep its old batch
            # size through rows leaving or joining, and the next forward would not match it.
            self.cache = DynamicCache()
            if self.mask is not None:
                self.mask = self.mask[:, :0]
            self._slots = 0
            return
        if slots < self._slots:
            self.cache.crop(slots - self._slots)  # transformers 5.x: a negative count of slots to remove
            if self.mask is not None:
                self.mask = self.mask[:, :slots]
            self._slots = slots


class _RowKV:
    """One row's cached keys and values, per layer [heads, tokens, dim]."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int):
        self.keys, self.values, self.length = keys, values, length
        self.nbytes = sum(t.numel() * t.element_size() for t in keys + values)  # what the prefix cache budgets


def _eos_ids(model) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        ids |= token_ids(getattr(source, "eos_token_id", None))
    return ids


def _empty_like(layer, batch: int):
    """A copy of a cache layer for `batch` rows with no slots (to be left-padded with holes)."""
    empty = copy.copy(layer)
    empty.keys = layer.keys.new_zeros(batch, layer.keys.shape[1], 0, layer.keys.shape[3])
    empty.values = layer.values.new_zeros(batch, layer.values.shape[1], 0, layer.values.shape[3])
    return empty


def _left_pad(kv: torch.Tensor, slots: int) -> torch.Tensor:
    """[B, H, S, D] → [B, H, slots, D] with zeros before (masked holes, never attended)."""
    missing = slots - kv.shape[2]
    return kv if missing == 0 else torch.cat([kv.new_zeros(*kv.shape[:2], missing, kv.shape[3]), kv], dim=2)


def _left_pad_mask(mask, batch: int, slots: int, width: int, device) -> torch.Tensor:
    mask = mask if mask is not None else torch.ones(batch, slots, dtype=torch.bool, device=device)
    return torch.cat([torch.zeros(batch, width - slots, dtype=torch.bool, device=device), mask], dim=1)


def load(source, options):
    """The transformers backend's loader: the model as transformers loads it, run by HFBackend."""
    from ..models.sources import load_transformers

    if options.backend_options:
        raise ValueError(f"the transformers backend takes no backend_options (got {sorted(options.backend_options)})")
    return load_transformers(source, options)


register_backend("transformers", load, help="any transformers causal LM, on CPU or GPU")
