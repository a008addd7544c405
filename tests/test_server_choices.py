"""n choices and ignore_eos on a live server: n rows per prompt, each with its own random stream (row r of a request
seeded S draws the stream (S, r), as row r of the engine's generate does), choices indexed 0..n-1 per prompt in
order, usage counting a prompt once; streaming chunks name their choice; ignore_eos decodes past EOS."""

from __future__ import annotations

import json

import httpx
import pytest

from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import chat_ids, openai_client
from test_server_helpers import MODEL, make_generator, serve

PROMPT = "def quicksort(arr):"
MESSAGES = [{"role": "user", "content": "Sort a list."}]


@pytest.fixture(scope="module")
def server(tiny_pair, tokenizer):
    srv = serve(tiny_pair, tokenizer, max_tokens_limit=256, max_batch_size=8, request_timeout=60)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(tiny_pair, tokenizer):
    return make_generator(tiny_pair, tokenizer)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)



def test_n_sampled_choices_differ_and_greedy_ones_agree(client, engine, tokenizer):
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=16, temperature=1.0)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len({c.text for c in sampled.choices}) == 3
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=16, temperature=0)
    solo = engine.generate(PROMPT, max_new_tokens=16, temperature=0)
    assert [c.text for c in greedy.choices] == solo.texts * 3
    assert greedy.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])  # the prompt counts once
    assert greedy.usage.completion_tokens == 3 * len(solo.token_ids[0])
    assert greedy.model_extra["speculative"]["batch_size"] >= 3  # the choices decoded side by side
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=12, temperature=0.9)
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 3


def test_a_seeded_request_of_n_choices_reproduces_itself_and_the_engine(client, engine, tokenizer):
    kwargs = dict(model=MODEL, prompt=PROMPT, n=2, max_tokens=16, temperature=0.9, seed=77)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices] and texts[0] != texts[1]
    solo = engine.generate([PROMPT, PROMPT], max_new_tokens=16, temperature=0.9, seed=77)  # rows (77, 0), (77, 1)
    assert texts == solo.texts
    one = client.completions.create(**{**kwargs, "n": 1})
    assert one.choices[0].text == texts[0]  # choice 0 is what n = 1 gets
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=10, temperature=0.9,
                                          seed=3)
    ids = chat_ids(tokenizer, MESSAGES)
    assert [c.message.content for c in chat.choices] == engine.generate([ids, ids], max_new_tokens=10,
                                                                        temperature=0.9, seed=3).texts


def test_n_choices_of_several_prompts_are_ordered_prompt_by_prompt(client, engine, tokenizer):
    prompts = ["import numpy", "Once upon a time"]
    res = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0.8, seed=5)
    solo = engine.generate([p for p in prompts for _ in range(2)], max_new_tokens=8, temperature=0.8, seed=5)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    assert [c.text for c in res.choices] == solo.texts
    assert res.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert res.usage.completion_tokens == sum(len(t) for t in solo.token_ids)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_choices_carry_their_index(server, endpoint):
    body = {"max_tokens": 12, "temperature": 0.9, "seed": 12, "n": 3,
            **({"prompt": PROMPT} if endpoint == "/v1/completions" else {"messages": MESSAGES})}
    whole = httpx.post(f"{server.url}{endpoint}", json=body, timeout=60).json()
    with httpx.stream("POST", f"{server.url}{endpoint}", json={**body, "stream": True}, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    texts, reasons, roles = ["", "", ""], [None] * 3, [0] * 3
    for chunk in map(json.loads, lines[:-1]):
        (choice,) = chunk["choices"]
        i = choice["index"]
        if endpoint == "/v1/completions":
            texts[i] += choice["text"]
        else:
            texts[i] += choice["delta"].get("content", "")
            roles[i] += choice["delta"].get("role") == "assistant"
        if choice["finish_reason"]:
            assert reasons[i] is None
            reasons[i] = choice["finish_reason"]
    key = "text" if endpoint == "/v1/completions" else "message"
    expected = [c[key] if key == "text" else c[key]["content"] for c in whole["choices"]]
    assert texts == expected and len(set(texts)) == 3
    assert reasons == [c["finish_reason"] for c in whole["choices"]]
    if endpoint == "/v1/chat/completions":
        assert roles == [1, 1, 1]  # each choice opens with its role


def test_ignore_eos_decodes_past_the_end_of_sequence(client, engine):
    # a seeded sample that ends at EOS well before its limit
    seed = next(s for s in range(200)
                if engine.generate(PROMPT, max_new_tokens=48, temperature=1.5, seed=s).finish_reasons[0] == "stop")
    ends = engine.generate(PROMPT, max_new_tokens=48, temperature=1.5, seed=seed)
    assert ends.token_ids[0][-1] in engine.eos_token_ids
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=1.5, seed=seed)
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == ends.texts[0]
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=1.5, seed=seed,
                                    extra_body={"ignore_eos": True})
    past = engine.generate(PROMPT, max_new_tokens=48, temperature=1.5, seed=seed, ignore_eos=True)
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == 48
    assert res.choices[0].text == past.texts[0] and len(past.token_ids[0]) == 48
