"""llamacpp-plain: llama-cpp-python's own generation loop (`Llama.generate`) on the target's GGUF file, same
threads, end of generation ignored."""

from __future__ import annotations

from .llamacpp import LlamaCppPython


class LlamaCppPlain(LlamaCppPython):
    name = "llamacpp-plain"
