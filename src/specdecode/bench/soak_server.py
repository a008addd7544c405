"""`bench soak --serve`: a `specdecode serve` of the soak's own, with every cache's bound set so that each fills
during the warm-up. A soak of a server at its default bounds cannot tell a leak from a cache still filling (the
tiny models' 65,536-token prefix cache took far longer than a 4-minute soak to fill); at small bounds everything is
full within the warm-up, and what grows after it is kept by nothing bounded.

The caches and their settings: the prefix cache (`--prefix-cache-tokens`), the suffix draft's history
(`--suffix-history-tokens`), the compiled grammars (`--grammar-cache`), and on the transformers backend oneDNN's
kernels, one per weight shape and forward width (~0.55 MiB each, half in oneDNN's primitive cache and half in
ideep's, 1024 entries each by default: with a few weight shapes and ~50 forward widths they fill only as rare
widths come, models/optimize.py), bounded by the environment variables ONEDNN_PRIMITIVE_CACHE_CAPACITY and
LRU_CACHE_CAPACITY, read when the process first runs a kernel (so they are set for the server, not here).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

from .llama_server import ServerProcess

KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
STARTUP_TIMEOUT_S = 900.0  # a first start may convert or time a model (README: the first run)


@dataclass(frozen=True)
class CacheBounds:
    """The bounds a soak's own server runs with (None: the server's default)."""

    prefix_cache_tokens: int | None = None
    suffix_history_tokens: int | None = None
    grammar_cache: int | None = None
    kernel_cache: int | None = None  # kernels per cache (oneDNN's and ideep's)

    def __post_init__(self):
        for name, value in self.__dict__.items():
            low = 0 if name == "prefix_cache_tokens" else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    @property
    def given(self) -> bool:
        return any(v is not None for v in self.__dict__.values())

    def flags(self) -> list[str]:
        """The `specdecode serve` flags of the bounds given."""
        flags = []
        for name, flag in (("prefix_cache_tokens", "--prefix-cache-tokens"),
                           ("suffix_history_tokens", "--suffix-history-tokens"), ("grammar_cache", "--grammar-cache")):
            if getattr(self, name) is not None:
                flags += [flag, str(getattr(self, name))]
        return flags

    def env(self) -> dict[str, str]:
        if self.kernel_cache is None:
            return {}
        return {name: str(self.kernel_cache) for name in KERNEL_CACHE_VARIABLES}


class SoakServer(ServerProcess):
    """`specdecode serve ARGS` on 127.0.0.1 with the bounds' flags after ARGS (so they win over the same flags in
    ARGS), the bounds' environment, and this Python: `with SoakServer(args, bounds) as server: server.url`."""

    name = "specdecode serve"

    def __init__(self, serve_args: str | list[str], bounds: CacheBounds = CacheBounds(),
                 startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.serve_args = shlex.split(serve_args) if isinstance(serve_args, str) else list(serve_args)
        for flag in ("--host", "--port", "--ray"):
            if flag in self.serve_args:
                raise ValueError(f"--serve starts its own server on 127.0.0.1 and a free port: leave {flag} out")
        self.bounds = bounds
        super().__init__(startup_timeout_s, bounds.env())

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "specdecode", "serve", *self.serve_args, "--host", "127.0.0.1",
                "--port", str(self.port), *self.bounds.flags()]
