"""Scripted tiny models for the tool-calling tests (no tests here): a tiny random Qwen whose logits get a large bonus
on the next token of a script, so that an agent session under tool_choice "auto" really calls tools. The script is a
function of the prompt's text (what the answer should be), e.g. a call while no tool result is in the prompt, then
an answer; the bonus goes to the next token of that text after what the answer holds so far, and to the
end-of-sequence token once it is written (or once the answer left the script). Target and draft are both scripted
(the draft a perturbed copy), so speculation, the grammar, the parser and the prefix cache run as for any model."""

from __future__ import annotations

import copy
import inspect
import json

from conftest import perturbed_copy, tiny_qwen
from test_server_tools import QWEN25_TEMPLATE

HEADER = "assistant\n"  # what follows <|im_start|> where an answer begins


def call(name: str, arguments: dict) -> str:
    """A Hermes / Qwen2.5 tool call, as the template writes it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def tool_tokenizer(tokenizer):
    """The tests' tokenizer with Qwen2.5's chat template and <tool_call>, </tool_call> as tokens of their own."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN25_TEMPLATE.strip()
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # not special, as in Qwen2.5's vocabulary
    return tok


def scripted_pair(tokenizer, script, positions: int = 2048):
    """(target, draft) over the tokenizer's vocabulary, both following script(prompt text) -> answer text."""
    target = tiny_qwen(len(tokenizer), seed=0, eos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    draft = perturbed_copy(target, 0.3, seed=1)
    pair = [scripted(model, tokenizer, script) for model in (target, draft)]
    for model in pair:
        model.config.max_position_embeddings = positions
    return pair


def scripted(model, tokenizer, script):
    """A copy of the tiny model whose greedy answer to a prompt is script(prompt's text)."""
    from transformers import Qwen2ForCausalLM

    class Scripted(Qwen2ForCausalLM):
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            out = super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
            self._remember(input_ids, position_ids)
            kept = out.logits.shape[1]
            for row in range(out.logits.shape[0]):
                for j, pos in enumerate(position_ids[row, -kept:].tolist()):
                    token = self._next(self.seen[row][:pos + 1])
                    if token is not None:
                        out.logits[row, j, token] += 1e4
            return out

        forward.__signature__ = inspect.signature(Qwen2ForCausalLM.forward)

        def _remember(self, input_ids, position_ids):
            # Each row's tokens by position: a prefix-cache hit skips the forward of positions that hold the same
            # tokens as when they were last written, and a rejected draft is overwritten by the next forward.
            for row in range(input_ids.shape[0]):
                seen = self.seen.setdefault(row, [])
                for token, pos in zip(input_ids[row].tolist(), position_ids[row].tolist()):
                    seen.extend([None] * (pos + 1 - len(seen)))
                    seen[pos] = token

        def _next(self, context: list) -> int | None:
            starts = [i for i, t in enumerate(context) if t == self.im_start]
            if not starts or None in context:
                return None
            text = self.tok.decode(context[starts[-1] + 1:])
            if not text.startswith(HEADER):
                return None
            written = text[len(HEADER):]
            answer = self.script(self.tok.decode(context[:starts[-1]]))
            if not answer.startswith(written):
                return self.eos
            rest = answer[len(written):]
            return self.tok(rest, add_special_tokens=False)["input_ids"][0] if rest else self.eos

    copy_ = Scripted(model.config).eval()
    copy_.load_state_dict(model.state_dict())
    copy_.seen, copy_.tok, copy_.script = {}, tokenizer, script
    copy_.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    copy_.eos = model.config.eos_token_id
    return copy_
