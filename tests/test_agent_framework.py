"""A real agent framework from PyPI (pydantic-ai, the `[test]` extra) runs a tool-using session against a live
`specdecode` server, unchanged, as its users run it: tools in `tool_choice: "auto"`, the framework's own OpenAI
client, its own tool execution and history. The tiny models are scripted so that the call really happens: each adds
a large logit to the next token of a fixed answer (a `<tool_call>` of get_weather for Paris while the prompt holds
no tool result, then a sentence that uses the result), on top of their random logits, target and draft alike; the
server's grammar, parser, speculation and prefix cache run as they do for any model. Under auto mode nothing forces
the call: the model's own tokens start it."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from conftest import perturbed_copy, tiny_qwen
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, serve
from test_server_tools import QWEN25_TEMPLATE

pytest.importorskip("pydantic_ai", reason="the agent-framework test needs pydantic-ai-slim[openai] (the [test] extra)")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 21 C in Paris."
HEADER = "assistant\n"  # what follows <|im_start|> where the answer begins


def scripted(model, tokenizer):
    """A copy of the tiny model whose greedy answer is CALL, or ANSWER once a tool result is in the prompt."""
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
            script = ANSWER if "<tool_response>" in self.tok.decode(context[:starts[-1]]) else CALL
            if not script.startswith(written):
                return self.eos
            rest = script[len(written):]
            return self.tok(rest, add_special_tokens=False)["input_ids"][0] if rest else self.eos

    copy_ = Scripted(model.config).eval()
    copy_.load_state_dict(model.state_dict())
    copy_.seen, copy_.tok = {}, tokenizer
    copy_.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    copy_.eos = model.config.eos_token_id
    return copy_


@pytest.fixture(scope="module")
def server(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN25_TEMPLATE.strip()
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # one token each, as in Qwen2.5's vocabulary
    target = tiny_qwen(len(tok), seed=0, eos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    draft = perturbed_copy(target, 0.3, seed=1)
    pair = [scripted(m, tok) for m in (target, draft)]
    for model in pair:
        model.config.max_position_embeddings = 2048
    srv = serve(pair, tok, k=3, max_tokens_limit=200, request_timeout=120)
    yield srv
    srv.stop()


def test_pydantic_ai_calls_the_tool_and_answers_with_its_result(server):
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    import json

    import httpx
    from openai import AsyncOpenAI

    sent = []

    async def capture(request):
        sent.append(json.loads(request.content))

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none",
                         http_client=httpx.AsyncClient(event_hooks={"request": [capture]}))
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, model_settings={"temperature": 0.0, "max_tokens": 80})
    cities = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        cities.append(city)
        return "21 C"

    torch.manual_seed(0)
    result = agent.run_sync("What is the weather in Paris?")
    assert cities == ["Paris"]  # the framework parsed our tool_calls and ran its tool
    assert result.output == ANSWER  # the model's second turn saw the tool's result and answered in text
    parts = [part for message in result.all_messages() for part in message.parts]
    [call] = [p for p in parts if isinstance(p, ToolCallPart)]
    [returned] = [p for p in parts if isinstance(p, ToolReturnPart)]
    assert call.tool_name == "get_weather" and call.args_as_dict() == {"city": "Paris"}
    assert returned.tool_call_id == call.tool_call_id and returned.content == "21 C"
    assert result.usage.requests == 2 and result.usage.input_tokens > 0
    assert len(sent) == 2 and all(body.get("tool_choice", "auto") == "auto" and body["tools"] for body in sent)
