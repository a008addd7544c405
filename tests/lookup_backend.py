"""A model backend written in pure torch, with no transformers behind it: the next-token logits are a fixed random
table indexed by the previous two tokens. It has a real KV "cache" (the token history per row) that the loop must
grow, trim and select exactly, so it exercises the backend interface as a third-party backend would."""

from __future__ import annotations

import copy

import torch


class LookupBackend:
    def __init__(self, vocab_size: int = 32, seed: int = 0, sharpness: float = 3.0, max_positions: int = 4096):
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab_size, vocab_size, vocab_size, generator=gen) * sharpness \
            if vocab_size <= 64 else None
        self._seed, self._sharpness = seed, sharpness
        self.vocab_size = vocab_size
        self.device = torch.device("cpu")
        self.max_positions = max_positions
        self.eos_token_ids: set[int] = set()
        self.name = f"lookup-{vocab_size}-{seed}"
        self.forward_calls = 0
        self.reset(1)

    def _logits(self, before: int, last: int) -> torch.Tensor:
        if self.table is not None:
            return self.table[before, last]
        # Large vocabularies: a row of logits made from the pair, without a V^3 table.
        gen = torch.Generator().manual_seed(self._seed * 1_000_003 + before * 7919 + last)
        return torch.randn(self.vocab_size, generator=gen) * self._sharpness

    def reset(self, batch_size: int) -> None:
        self.history: list[list[int]] = [[] for _ in range(batch_size)]

    @property
    def lengths(self) -> list[int]:
        return [len(h) for h in self.history]

    def forward(self, input_ids, valid=None, last_only=False, output_hidden=False):
        self.forward_calls += 1
        batch, n = input_ids.shape
        out = torch.empty(batch, n, self.vocab_size)
        for b in range(batch):
            for j in range(n):
                if valid is not None and not valid[b, j]:
                    out[b, j] = 0.0
                    continue
                self.history[b].append(int(input_ids[b, j]))
                h = self.history[b]
                out[b, j] = self._logits(h[-2] if len(h) > 1 else 0, h[-1])
        if last_only:
            if valid is not None:  # each row's last real token
                last = (valid.long() * torch.arange(1, n + 1)).argmax(dim=1)
                out = out[torch.arange(batch), last].unsqueeze(1)
            else:
                out = out[:, -1:]
        if output_hidden:
            return out, out.clone()
        return out

    def fork(self, batch_size: int) -> "LookupBackend":
        other = copy.copy(self)
        other.reset(batch_size)
        return other

    def merge(self, other: "LookupBackend") -> None:
        self.history += other.history

    def trim(self, lengths: list[int]) -> None:
        self.history = [h[:n] for h, n in zip(self.history, lengths)]

    def select_rows(self, rows: list[int]) -> None:
        self.history = [self.history[r] for r in rows]

    def exact_next(self, tokens: list[int]) -> torch.Tensor:
        """The next-token logits after a whole sequence, computed directly (the reference for tests)."""
        return self._logits(tokens[-2] if len(tokens) > 1 else 0, tokens[-1])
