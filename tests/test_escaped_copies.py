"""Escaped copies (drafters/escaped_copies.py): for a request whose answer is JSON (tools, a json response_format)
the server adds the tool and user messages' texts, JSON-escaped and tokenized, to the suffix drafter's history under
the key of the row the request becomes, before that row joins (its mark includes them), each distinct text once.
A call that writes back a file it read then copies it from that document. Drafts only: greedy answers stay the
target's own, with the feature on and off and without speculation."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lookup_backend import LookupBackend
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, LiveServer, openai_client
from test_server_tools import QWEN25_TEMPLATE

from specdecode import SpeculativeGenerator
from specdecode.drafters import ModelDrafter, SuffixDrafter, SuffixHistory, SuffixModelDrafter
from specdecode.drafters.escaped_copies import EscapedCopies, escaped, escaped_texts, suffix_of
from specdecode.server import ServerSettings, create_app
from specdecode.structured.tool_calls import HEAD, NAME_END, TAIL

OLD = ('def mean(xs):\n    return sum(xs) / len(xs)\n\n\ndef label(x):\n    return "big" if x > 10 else "small"\n\n\n'
       'def path():\n    return "C:\\\\data\\\\in.txt"\n\n\ndef quote(s):\n    return "\\"" + s + "\\""\n')
NEW = '"""Small helpers."""\n' + OLD  # the answer writes the file back with a docstring on top
WRITE = {"type": "function", "function": {
    "name": "write_file", "description": "Replace a file's whole content.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"], "additionalProperties": False}}}
READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                   "additionalProperties": False}}}
MESSAGES = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Add a module docstring to a.py."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_read", "type": "function",
                 "function": {"name": "read_file", "arguments": json.dumps({"path": "a.py"})}}]},
            {"role": "tool", "tool_call_id": "call_read", "content": OLD}]
ANSWER = HEAD + "write_file" + NAME_END + json.dumps({"path": "a.py", "content": NEW}) + TAIL


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN25_TEMPLATE.strip()
    return tok


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------- the unit
def test_escaped_texts_are_those_json_changes_of_tool_and_user_messages_once_each():
    assert escaped('a\n"b"\\') == 'a\\n\\"b\\"\\\\' and escaped("plain text") is None
    assert escaped("café\n") == "café\\n"  # ensure_ascii=False: text stays as models write it
    messages = [("system", "s\n"), ("user", "u\n"), ("assistant", "a\n"), ("tool", "t\n"), ("tool", "u\n"),
                ("user", "no escapes"), ("tool", "")]
    assert escaped_texts(messages) == ["u\\n", "t\\n"]


def test_each_distinct_text_is_added_once_under_the_next_rows_key(tool_tokenizer):
    drafter = SuffixDrafter(SuffixHistory(10_000), key="tenant")
    copies = EscapedCopies(drafter, tool_tokenizer)
    texts = escaped_texts([("tool", OLD), ("user", "x = 'a'\n")])
    assert copies.add(texts) == 2 and drafter.history.documents == 2
    assert copies.add(texts) == 0 and drafter.history.documents == 2  # the next turn re-sends them
    assert drafter.history.keys == ["tenant"]
    # the document is the escaped text's tokens: its continuation is drafted after the escaped text's start
    tokens = ids(tool_tokenizer, escaped(OLD))
    assert drafter.history.speculate(tokens[:12], "tenant", 8, 0.1).tokens == tokens[12:20]
    drafter.queue_keys(["alice"])  # the next row to join is alice's: her history takes them
    assert copies.add(texts) == 2 and sorted(drafter.history.keys, key=str) == ["alice", "tenant"]
    assert drafter.history.speculate(tokens[:12], "alice", 8, 0.1).tokens == tokens[12:20]


def test_a_text_whose_document_was_evicted_is_added_again(tool_tokenizer):
    tokens = len(ids(tool_tokenizer, escaped(OLD)))
    drafter = SuffixDrafter(SuffixHistory(tokens + 10))
    copies = EscapedCopies(drafter, tool_tokenizer)
    assert copies.add([escaped(OLD)]) == 1
    drafter.history.add(list(range(20)))  # another document pushes it out
    assert drafter.history.documents == 1
    assert copies.add([escaped(OLD)]) == 1


def test_suffix_and_model_drafters_histories(tiny_pair, tool_tokenizer):
    plain_suffix = SuffixDrafter()
    assert suffix_of(plain_suffix) is plain_suffix
    combined = SuffixModelDrafter(tiny_pair[1], vocab_size=len(tool_tokenizer))
    assert suffix_of(combined) is combined.suffix
    assert EscapedCopies(combined, tool_tokenizer).add([escaped(OLD)]) == 1
    assert combined.suffix.history.documents == 1
    for none in (ModelDrafter(tiny_pair[1]), None, SuffixDrafter(history_tokens=0)):
        copies = EscapedCopies(none, tool_tokenizer)
        assert not copies.active and copies.add([escaped(OLD)]) == 0


# ---------------------------------------------------------------------------------------------- a copying target
class ScriptBackend(LookupBackend):
    """A target that, after the last `<|im_start|>assistant\\n`, writes `script` and then `<|im_end|>`: at each
    position its largest logit is the longest token that extends the text written so far along the script (any
    tokenization of it, a grammar's forced tokens included). Everything else is flat: greedy follows the script."""

    def __init__(self, tokenizer, script: str):
        super().__init__(vocab_size=len(tokenizer), max_positions=4096)
        self.script, self.start = script, ids(tokenizer, "<|im_start|>assistant\n")
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.eos_token_ids = {self.end, tokenizer.convert_tokens_to_ids("<|endoftext|>")}
        self.texts = [tokenizer.decode([t]) for t in range(len(tokenizer))]

    def next_token(self, history: list[int]) -> int | None:
        n = len(self.start)
        at = next((i for i in range(len(history) - n, -1, -1) if history[i:i + n] == self.start), None)
        if at is None:
            return None
        written = "".join(self.texts[t] for t in history[at + n:])
        if written == self.script:
            return self.end
        if not self.script.startswith(written):
            return None
        rest = self.script[len(written):]
        return max((t for t, s in enumerate(self.texts) if s and t != self.end and rest.startswith(s)),
                   key=lambda t: len(self.texts[t]))

    def forward(self, input_ids, valid=None, last_only=False, output_hidden=False):
        self.forward_calls += 1
        batch, n = input_ids.shape
        out = torch.zeros(batch, 1 if last_only else n, self.vocab_size)
        for b in range(batch):
            real = [j for j in range(n) if valid is None or valid[b, j]]
            for j in real:
                self.history[b].append(int(input_ids[b, j]))
                if last_only and j != real[-1]:
                    continue
                token = self.next_token(self.history[b])
                if token is not None:
                    out[b, 0 if last_only else j, token] = 10.0
        return (out, out.clone()) if output_hidden else out


def script_server(tool_tokenizer, drafter, escaped_copies: bool = True) -> LiveServer:
    target = ScriptBackend(tool_tokenizer, ANSWER)
    generator = SpeculativeGenerator(target, drafter, num_speculative_tokens=6, tokenizer=tool_tokenizer)
    settings = ServerSettings(max_tokens_limit=600, escaped_copies=escaped_copies)
    app = create_app(generator, MODEL, tool_tokenizer, settings)
    return LiveServer(app).start()


def write_call(client, **kwargs):
    kwargs = {"max_tokens": 500, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[READ, WRITE],
                                          tool_choice={"type": "function", "function": {"name": "write_file"}},
                                          **kwargs)


@pytest.mark.parametrize("draft", ["suffix", "suffix+model"])
def test_a_call_that_writes_back_a_file_it_read_copies_it_from_the_escaped_document(tool_tokenizer, tiny_pair, draft):
    answers = {}
    for on in (True, False):
        drafter = SuffixDrafter(SuffixHistory(100_000))
        if draft == "suffix+model":
            drafter = SuffixModelDrafter(tiny_pair[1], drafter, vocab_size=len(tool_tokenizer))
        server = script_server(tool_tokenizer, drafter, escaped_copies=on)
        try:
            client = openai_client(server.url, timeout=120)
            res = write_call(client)
            plain = write_call(client, extra_body={"num_speculative_tokens": 0})
        finally:
            server.stop()
        [call] = res.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"path": "a.py", "content": NEW}  # the target copies
        assert call.function.arguments == plain.choices[0].message.tool_calls[0].function.arguments
        answers[on] = (call.function.arguments, res.model_extra["speculative"])
        assert suffix_of(drafter).history.documents == (3 if on else 2)  # two rows, and the escaped file
    (text_on, on), (text_off, off) = answers[True], answers[False]
    assert text_on == text_off
    # The file's escaped text is a document of its own: the copy runs on across the escapes that end the raw
    # prompt's matches. Without it the drafts die at every \n and \".
    assert on["accepted_tokens"] >= off["accepted_tokens"] + 25, (on, off)  # measured: 148 against 114
    assert on["target_forward_calls"] < 0.75 * off["target_forward_calls"], (on, off)  # 60 against 94


def test_the_copies_join_before_the_row_and_only_for_json_answers(tool_tokenizer, monkeypatch):
    marks = []
    relayout = SuffixDrafter.relayout

    def recording(self, change):  # each joining row's mark: the history's documents before it are what it drafts from
        relayout(self, change)
        marks.extend(self._rows[t.id].mark for t in change.appended if t.id in self._rows)

    monkeypatch.setattr(SuffixDrafter, "relayout", recording)
    drafter = SuffixDrafter(SuffixHistory(100_000))
    server = script_server(tool_tokenizer, drafter)
    try:
        client = openai_client(server.url, timeout=120)
        text = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
        assert text.choices[0].finish_reason == "length" and drafter.history.documents == 1  # its own row only
        none = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[READ, WRITE], max_tokens=4,
                                              tool_choice="none", temperature=0)
        assert none.choices[0].message.tool_calls is None and drafter.history.documents == 2
        first = drafter.history.next_id
        write_call(client, max_tokens=8)
        escaped_doc = first  # the next document added was the escaped file, before the row joined
        assert drafter.history.documents == 4 and marks[-1] > escaped_doc
        assert drafter.history.speculate(ids(tool_tokenizer, escaped(OLD))[:12], None, 4, 0.1,
                                         before=escaped_doc + 1).tokens
        write_call(client, max_tokens=8)  # the same history again: nothing new but the row itself
        assert drafter.history.documents == 5
        json_answer = client.chat.completions.create(model=MODEL, messages=MESSAGES + [
            {"role": "user", "content": 'x = "y"\n'}], max_tokens=4, temperature=0,
            response_format={"type": "json_object"})
        assert json_answer.choices[0].finish_reason == "length"
        assert drafter.history.documents == 7  # the new user text, then the row
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------- exactness
@pytest.fixture(scope="module")
def long_target(tiny_pair):
    target = copy.deepcopy(tiny_pair[0])
    target.config.max_position_embeddings = 2048
    return target


@pytest.mark.parametrize("k", [4, "auto"])
def test_greedy_answers_are_the_targets_own_with_the_copies_on_and_off(long_target, tool_tokenizer, k):
    answers = []
    for on in (True, False):
        drafter = SuffixDrafter(SuffixHistory(100_000))
        generator = SpeculativeGenerator(long_target, drafter, num_speculative_tokens=k, tokenizer=tool_tokenizer)
        app = create_app(generator, MODEL, tool_tokenizer, ServerSettings(max_tokens_limit=600, escaped_copies=on))
        server = LiveServer(app).start()
        try:
            client = openai_client(server.url, timeout=120)
            for extra in ({}, {"num_speculative_tokens": 0}):
                for _ in range(2):  # the second time the history holds the first answer too
                    res = write_call(client, max_tokens=60, extra_body=extra)
                    choice = res.choices[0]
                    answers.append((choice.finish_reason, choice.message.content, [
                        (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]))
        finally:
            server.stop()
    assert all(a == answers[0] for a in answers), answers
