"""The server's prefix cache on a live uvicorn over the tiny models: a second chat with the same system prompt
reuses the first one's KV (usage.prompt_tokens_details.cached_tokens, /metrics), answers exactly what a server
without the cache answers, and the switch and its limits are checked."""

from __future__ import annotations

import pytest

from specdecode.errors import OptionError
from specdecode.server import ServerSettings
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import metric, metric_values, openai_client, serve

SYSTEM = "You are a careful Python reviewer. " + " ".join(f"Rule {i}: name things for what they are." for i in range(8))


def _chat(client, user: str, **extra):
    extra = {"temperature": 0, **extra}
    return client.chat.completions.create(model="specdecode", max_tokens=12, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], **extra)


@pytest.fixture(scope="module")
def servers(tiny_pair, tokenizer):
    cached = serve(tiny_pair, tokenizer, k=3, max_batch_size=4)
    cold = serve(tiny_pair, tokenizer, k=3, max_batch_size=4, prefix_cache_tokens=0)
    yield cached, cold
    cached.stop()
    cold.stop()


def test_a_shared_system_prompt_is_prefilled_once_and_answers_stay_the_same(servers):
    cached, cold = servers
    client, plain = openai_client(cached.url), openai_client(cold.url)
    first = _chat(client, "Review: def f(x): return x")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    for user in ("Review: def g(y): return y * 2", "Review: class A: pass"):
        second = _chat(client, user)
        cached_tokens = second.usage.prompt_tokens_details.cached_tokens  # the OpenAI client's typed field
        assert cached_tokens >= 0.8 * first.usage.prompt_tokens
        assert second.choices[0].message.content == _chat(plain, user).choices[0].message.content
    assert _chat(plain, "Review: x = 1").usage.prompt_tokens_details.cached_tokens == 0  # the switch
    values = metric_values(cached.url)
    assert metric(values, "specdecode_prefix_cache_hit_tokens") >= 2 * 0.8 * first.usage.prompt_tokens
    assert metric(values, "specdecode_prefix_cache_hits") >= 2
    assert 0 < metric(values, "specdecode_prefix_cache_hit_rate") < 1
    assert metric(metric_values(cold.url), "specdecode_prefix_cache_hit_tokens") == 0


def test_streamed_and_sampled_requests_match_the_cold_server(servers):
    cached, cold = servers
    client, plain = openai_client(cached.url), openai_client(cold.url)
    _chat(client, "warm up")
    options = dict(temperature=0.9, seed=7)
    stream = _chat(client, "Review: y = [1, 2]", stream=True, stream_options={"include_usage": True}, **options)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert text == _chat(plain, "Review: y = [1, 2]", **options).choices[0].message.content


@pytest.mark.parametrize("field", ["prefix_cache_tokens", "prefix_cache_rows"])
def test_limits_are_checked(field):
    with pytest.raises(OptionError, match=field):
        ServerSettings(**{field: -1})
    assert ServerSettings(max_batch_size=8, prefix_cache_rows=4).model_rows == 12
    assert ServerSettings(max_batch_size=8, prefix_cache_tokens=0).model_rows == 8
