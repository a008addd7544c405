"""`serve --json-layout`: a response_format's JSON compact by default, or laid out as the model writes it (bounded
whitespace between tokens), which equals asking for that layout in the schema's own "x-guidance"; a schema that
sets its own layout keeps it; a bad value is refused naming the choices."""

from __future__ import annotations

import json
import re

import pytest

from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import openai_client
from test_server_helpers import MODEL, serve

from specdecode.errors import OptionError
from specdecode.server import ServerSettings
from specdecode.structured.tool_patterns import FREE_LAYOUT

MESSAGES = [{"role": "user", "content": "Pick a colour."}]
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["colour", "ok"], "additionalProperties": False}
OUTSIDE_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def servers(tiny_pair, tokenizer):
    compact = serve(tiny_pair, tokenizer, max_tokens_limit=256, json_layout="compact")
    model = serve(tiny_pair, tokenizer, max_tokens_limit=256, json_layout="model")
    yield openai_client(compact.url, timeout=120), openai_client(model.url, timeout=120)
    compact.stop()
    model.stop()


def _answer(client, response_format, seed=None, temperature=0.0) -> str:
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=temperature,
                                          seed=seed, response_format=response_format)
    return chat.choices[0].message.content


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_model_layout_is_the_schemas_own_free_layout(servers, seed):
    compact, model = servers
    laid_out = _answer(model, _format(SCHEMA), seed, temperature=1.0)
    assert laid_out == _answer(compact, _format({**SCHEMA, "x-guidance": FREE_LAYOUT}), seed, temperature=1.0)
    # ... and the compact default has no whitespace outside its strings
    assert not re.search(r"\s", OUTSIDE_STRINGS.sub("", _answer(compact, _format(SCHEMA), seed, temperature=1.0)))


def test_the_model_layout_lets_whitespace_in_within_its_bound(servers):
    _, model = servers
    texts = [_answer(model, _format(SCHEMA), seed, temperature=1.5) for seed in range(6)]
    gaps = [gap for text in texts for gap in re.split(r"[^\s]+", OUTSIDE_STRINGS.sub("x", text))]
    assert any(gaps)  # a random model at T = 1.5 writes whitespace where it may
    assert all(gap.count("\n") <= 1 and len(gap) <= 2 + 1 + 24 for gap in gaps)
    for text in texts:
        if text.rstrip().endswith("}"):
            assert set(json.loads(text)) == {"colour", "ok"}


def test_a_schema_that_sets_its_own_layout_keeps_it(servers):
    compact, model = servers
    own = _format({**SCHEMA, "x-guidance": {"whitespace_flexible": False}})
    assert _answer(model, own, 5, temperature=1.0) == _answer(compact, _format(SCHEMA), 5, temperature=1.0)
    lenient = _format({**SCHEMA, "x-guidance": {"lenient": True}})  # no layout of its own: it takes the server's
    assert _answer(model, lenient, 5, temperature=1.0) == _answer(
        compact, _format({**SCHEMA, "x-guidance": {**FREE_LAYOUT, "lenient": True}}), 5, temperature=1.0)


def test_json_object_takes_the_layout_too(servers):
    compact, model = servers
    assert _answer(model, {"type": "json_object"}, 7, 1.0) == _answer(
        compact, _format({"type": "object", "x-guidance": FREE_LAYOUT}), 7, 1.0)


def test_an_unknown_layout_is_refused_naming_the_choices():
    with pytest.raises(OptionError, match="json_layout must be one of compact, model"):
        ServerSettings(json_layout="pretty")
