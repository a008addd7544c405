"""llamacpp-json-schema: llama-cpp-python's own structured outputs on the target's GGUF file, the peer of ours on
the json workload: `create_completion` on the same prompt token ids (the chat template applied by us, so both
decode the very same prompt) with the grammar `LlamaGrammar.from_json_schema` makes of the prompt's schema, the
same max new tokens and sampling settings, rows one after another.

Its grammar allows one optional space between JSON tokens (llama.cpp's json-schema-to-GBNF); ours compiles the
schema compact (none): the outputs may differ by whitespace, and ours may need a few tokens fewer.
"""

from __future__ import annotations

from ..units import Measurement, Unit
from .llamacpp import LlamaCppPython


class LlamaCppJsonSchema(LlamaCppPython):
    name = "llamacpp-json-schema"
    structured = True
    structured_only = True

    def run(self, unit: Unit, batches, seed: int, schemas=None) -> Measurement:
        s = self.sampling(unit)
        per_tokens, per_seconds, texts = [], [], []
        for i, (rows, row_schemas) in enumerate(zip(batches, schemas)):
            seconds = 0.0
            for j, (ids, schema) in enumerate(zip(rows, row_schemas)):
                n, t, text = self.peers.complete_json(ids, schema, s["max_new_tokens"], s["temperature"],
                                                      s["top_k"], s["top_p"], seed + i * len(rows) + j)
                per_tokens.append(n)
                texts.append(text)
                seconds += t
            per_seconds.append(seconds)
        return Measurement(sum(per_tokens), sum(per_seconds), per_tokens, per_seconds, texts=texts)
