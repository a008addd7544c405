"""Walk tool calls along their tool grammar on the default pair's tokenizer, to the end token: forced positions,
one-hot masks, mask and compile times (docs/STRUCTURED_OUTPUTS.md, "Tool calling"), for a call in the template's
own form and in the fenced start form the default target writes. Needs the Qwen2.5-Coder tokenizer in the cache
(`specdecode models prepare qwen2.5-coder-1.5b-instruct` or any run of the default pair).

    python scripts/tool_grammar_walk.py
"""

from __future__ import annotations

import statistics
import time

from transformers import AutoTokenizer

from specdecode.structured.constraints import ConstraintSpec, GrammarCompiler
from specdecode.models import catalog
from specdecode.structured.tool_calls import parse_tools, tool_format

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
ANSWERS = {"<tool_call>": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", "days": 3}}'
                          '\n</tool_call>',
           "fenced": '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "unit": "c",\n'
                     '    "days": 3\n  }\n}\n```'}


def main() -> None:
    tok = AutoTokenizer.from_pretrained(str(catalog.tokenizer_path("qwen2.5-coder-1.5b-instruct")))
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    compiler = GrammarCompiler.for_tokenizer(tok, len(tok), eos_token_ids=eos)
    tools = parse_tools(TOOLS)
    for (form, answer), choice in [(a, c) for a in ANSWERS.items() for c in ("required", "auto")]:
        ids = tok(answer, add_special_tokens=False)["input_ids"] + eos[:1]
        start = time.perf_counter()
        grammar = compiler.compile(ConstraintSpec.of(grammar=tool_format(tok, tools, choice).grammar()))
        compile_ms = (time.perf_counter() - start) * 1e3
        matcher, times, forced, one_hot = grammar.matcher(), [], 0, 0
        for token in ids:
            start = time.perf_counter()
            mask = matcher.allowed()
            times.append((time.perf_counter() - start) * 1e3)
            if matcher.forced(1):
                forced += 1
                one_hot += mask.count() == 1
            assert mask.allows(token) and matcher.advance([token]) == 1, tok.decode([token])
        assert matcher.finished
        print(f"{form} {choice}: {len(ids)} tokens with the end token, {forced} positions forced, {one_hot} of them "
              f"one-hot; compile {compile_ms:.1f} ms; mask median {statistics.median(times):.2f} ms, max "
              f"{max(times):.1f} ms, after the call {times[-1]:.1f} ms")


if __name__ == "__main__":
    main()
