"""Incremental detokenization: the text of a row, token by token, is the text of its tokens decoded whole.

The detokenizer calls the `tokenizers` library directly where transformers' decode is exactly that call; these tests
hold the fast path to transformers' own decode, including special tokens and characters split across tokens.
"""

import random

from specdecode.text.detokenize import IncrementalDetokenizer, _rust_decoder


def _stream(tokenizer, ids, prompt):
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    return "".join(pieces), detok.text


def _slow(tokenizer):
    """The same detokenizer through transformers' decode (the fast path switched off)."""
    class Slow(type(tokenizer)):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs)
    slow = type(tokenizer).__new__(Slow)
    slow.__dict__.update(tokenizer.__dict__)
    return slow


def test_the_fast_path_is_taken_for_a_fast_tokenizer_and_not_for_an_overridden_decode(tokenizer):
    assert _rust_decoder(tokenizer) is not None
    assert _rust_decoder(_slow(tokenizer)) is None
    assert _rust_decoder(object()) is None


def test_streamed_text_equals_transformers_decode_of_the_whole_answer(tokenizer):
    rng = random.Random(0)
    text = "Ünïcödé → naïve café 😀 ok\n  def f(x):\n\treturn x * 2  # 日本語"
    answer = tokenizer.encode(text, add_special_tokens=False)
    specials = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    slow = _slow(tokenizer)
    for trial in range(20):
        ids = list(answer)
        for _ in range(trial % 4):  # special tokens anywhere, and random ids (byte pieces of broken characters)
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials + [rng.randrange(len(tokenizer))]))
        prompt = tokenizer.encode("Say it:", add_special_tokens=False)
        fast_text, fast_row = _stream(tokenizer, ids, prompt)
        slow_text, slow_row = _stream(slow, ids, prompt)
        assert fast_text == slow_text == fast_row == slow_row
        whole = tokenizer.decode(prompt[-4:] + ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert whole.endswith(fast_row)
    assert _stream(tokenizer, answer, None)[0] == text
