"""The engine: the generators (the public entry points), the running batch's step (session), rows joining
(admission), what the batch holds per row, and results."""

from .generators import AutoregressiveGenerator, SpeculativeGenerator, TokenStream

__all__ = ["AutoregressiveGenerator", "SpeculativeGenerator", "TokenStream"]
