"""specdecode-unconstrained and specdecode-plain-unconstrained: ours on the json workload's prompts WITHOUT their
schemas, the baseline the issue's "≥ 1.0× our own unconstrained decoding" compares with. Each row decodes the same
prompt token ids as free text, stops at its end-of-generation token (counted) or after max_new_tokens, as a user
who asks for JSON and gets whatever the model writes: the answers' lengths differ from the constrained ones (the
model often adds a ```json fence or prose), so prefill weighs differently on end-to-end tok/s; the report's
`decode_tokens_per_second` (after the prefill) compares the decoding alone. Their texts are checked like the
others (how often unconstrained output is valid JSON under the schema). Not run unless --methods names them."""

from __future__ import annotations

from ..units import Measurement, Unit
from .specdecode import SpecDecode
from .specdecode_plain import SpecDecodePlain, run_ours


class SpecDecodeUnconstrained(SpecDecode):
    name = "specdecode-unconstrained"
    plain = "specdecode-plain-unconstrained"
    recommends = False
    default = False
    structured_only = True
    on_request = True

    def run(self, unit: Unit, batches, seed: int, schemas=None) -> Measurement:
        return run_ours(self.generator(unit), batches, seed=seed, until_eos=True, **self.sampling(unit))

    def theory(self, k, blocks: dict, costs: dict) -> dict | None:
        return None


class SpecDecodePlainUnconstrained(SpecDecodePlain):
    name = "specdecode-plain-unconstrained"
    default = False
    structured_only = True
    on_request = True

    def run(self, unit: Unit, batches, seed: int, schemas=None) -> Measurement:
        return run_ours(self.ctx.plain, batches, seed=seed, until_eos=True, **self.sampling(unit))
