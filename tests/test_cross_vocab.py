"""Drafts of another tokenizer (drafters/cross_vocab.py): exactly the target's distribution under every sampling
setting, greedy identical to plain decoding, and drafts kept as often as the text allows.

Exactness: two tiny models over different real tokenizers, the target on the fixture's byte-level BPE (conftest) and
the draft on a SentencePiece-style one (cross_tokenizers.py), which splits the target's tokens otherwise ("arr" is
one target token, "a" + "rr" for the draft; the draft has no "ar"). A hook on their output layers confines both to
the tokens spelled with "a", "r" and " " (10 target tokens), so the target's joint distribution over three new tokens
is enumerable (100 outcomes over two tokens) from full forwards of the target alone, with the settings' penalties and grammar
restated by formula here. The engine's samples must follow it for both methods (SLEM: deterministic drafts; TLI: the
draft's q over the shared tokens), for a greedy row beside the sampled ones, and for seeded rows under a random K
(Gumbel-coupled).

Acceptance: a target that writes a fixed script and a draft that reads its own text and goes on with the script
(both table models over the two tokenizers): SLEM must keep nearly every draft, which it does only if the draft's
text comes back as the target's tokens right at the boundary (the power tests break it three ways).
"""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chi2

from conftest import tiny_qwen
from cross_tokenizers import build_metaspace_tokenizer
from reference import hf_warp
from specdecode import AutoregressiveGenerator, PromptLookupDrafter, SpeculativeGenerator
from specdecode.drafters.cross_vocab import CrossVocabDrafter
from specdecode.models.sources import LoadedModel
from specdecode.structured.constraints import ConstraintSpec, GrammarCompiler
from specdecode.text import token_bridge
from specdecode.text.token_bridge import TokenText

PROMPT_TEXT = " arr ar"
NEW = 3
JOINT = 2
ROWS = 800  # per setting and run (the engine's bookkeeping costs ~5 ms per row here: 3 runs take about a minute)
CHUNK = 2400  # rows per generate call
LEVEL = 1e-3  # per setting (18 of them): a real bug gives p << 1e-6 (see the power test)
REGEX = "( ar| a| r)+( ?)"


def setting(temperature=1.0, top_k=0, top_p=1.0, regex=None, **options):
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, regex=regex, options=options)


@pytest.fixture(scope="module")
def pair(tokenizer):
    """(target, draft): LoadedModels over the two tokenizers, each confined to the tokens of "a", "r" and " "."""
    draft_tok = build_metaspace_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    target = confine(tiny_qwen(len(tokenizer), seed=31, layers=2, hidden=32, eos_token_id=eos), tokenizer, 0.35)
    draft = confine(tiny_qwen(len(draft_tok), seed=32, layers=2, hidden=32, eos_token_id=draft_tok.eos_token_id),
                    draft_tok, 0.35)
    return LoadedModel(target, tokenizer, "target", ""), LoadedModel(draft, draft_tok, "draft", "")


def confine(model, tokenizer, scale: float):
    """The model's logits are -inf outside the tokens spelled with "a", "r" and " " (scale: how peaked the rest)."""
    codec = TokenText(tokenizer)
    allowed = [i for i, p in enumerate(codec.pieces) if p and set(p) <= set(b"ar ") and codec.kinds[i] == 0]
    bias = torch.full((len(tokenizer),), float("-inf"))
    bias[allowed] = 0.0
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias.to(output.dtype))
    model.allowed = allowed
    return model


SETTINGS = [
    setting(),
    setting(0.7, top_p=0.8),
    setting(1.4, top_k=4),
    setting(presence_penalty=1.0, repetition_penalty=1.3, logit_bias={"a": 2.0}),
    setting(0.9, frequency_penalty=1.5, min_p=0.1),
    setting(regex=REGEX),
]


# ---------------------------------------------------------------------------------------------- the reference
def by_formula(logits, prompt, counts, s, tokenizer):
    """logit_bias, repetition (prompt + output), frequency and presence (output), temperature, top-k, top-p, min_p:
    the formulas restated in float64, as tests/test_penalties_exact.py does."""
    options = s["options"]
    x = logits.double().clone()
    for text, value in options.get("logit_bias", {}).items():
        x[:, tokenizer.convert_tokens_to_ids(text)] += value
    seen = counts > 0
    seen[:, prompt] = True
    r = options.get("repetition_penalty", 1.0)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - options.get("frequency_penalty", 0.0) * counts - options.get("presence_penalty", 0.0) * (counts > 0)
    x = hf_warp(x, s["temperature"], s["top_k"], s["top_p"])
    if options.get("min_p"):
        from transformers.generation.logits_process import MinPLogitsWarper

        x = MinPLogitsWarper(options["min_p"])(None, x)
    return torch.softmax(x, dim=-1)


@torch.no_grad()
def exact_joint(model, tokenizer, prompt, s, length=JOINT) -> dict[tuple, float]:
    grammar = None
    if s["regex"] is not None:
        eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        grammar = GrammarCompiler.for_tokenizer(tokenizer, len(tokenizer), eos_token_ids=[eos]).compile(
            ConstraintSpec.of(regex=s["regex"]))
    probs = {(): 1.0}
    for _ in range(length):
        prefixes = list(probs)
        logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        counts = torch.zeros(len(prefixes), len(tokenizer), dtype=torch.float64)
        for i, p in enumerate(prefixes):
            for t in p:
                counts[i, t] += 1
        cond = by_formula(logits, prompt, counts, s, tokenizer)
        grown = {}
        for prefix, c in zip(prefixes, cond):
            if grammar is not None:
                matcher = grammar.matcher()
                assert matcher.advance(list(prefix)) == len(prefix)
                c = c * matcher.mask()
                c = c / c.sum()
            grown.update({prefix + (t,): probs[prefix] * c[t].item() for t in c.nonzero().flatten().tolist()})
        probs = grown
    return probs


def p_value(model, tokenizer, prompt, tokens: torch.Tensor, s) -> float:
    law = exact_joint(model, tokenizer, prompt, s)
    index = {seq: i for i, seq in enumerate(law)}
    observed = torch.zeros(len(law) + 1, dtype=torch.float64)
    for row in tokens[:, :JOINT].tolist():
        observed[index.get(tuple(row), len(law))] += 1
    probs = torch.tensor([*law.values(), 0.0], dtype=torch.float64)
    if observed[probs == 0].sum():
        return 0.0  # an outcome of probability 0
    expected = probs / probs.sum() * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs, exp = (obs[:-1], exp[:-1]) if exp[-1] == 0 else (obs, exp)
    return float(chi2.sf(float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1))


def sample(gen, tokenizer, settings=SETTINGS, rows=ROWS, seed=1234, **kwargs):
    """rows per setting, interleaved, one greedy row per CHUNK besides; [setting][row, token], the greedy rows, and
    the acceptance rate."""
    from specdecode.bench.stats import merge_stats

    prompt = tokenizer.encode(PROMPT_TEXT)
    batch = [s for _ in range(rows) for s in settings]
    tokens, greedy, stats = [], [], []
    for start in range(0, len(batch), CHUNK):
        part = batch[start:start + CHUNK] + [setting(0.0)]
        bias = [{tokenizer.convert_tokens_to_ids(t): v for t, v in s["options"].get("logit_bias", {}).items()}
                or None for s in part]
        options = {key: [s["options"].get(key, 1.0 if key == "repetition_penalty" else 0.0) for s in part]
                   for key in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")}
        result = gen.generate([prompt] * len(part), max_new_tokens=NEW, ignore_eos=True, logit_bias=bias,
                              temperature=[s["temperature"] for s in part], top_k=[s["top_k"] for s in part],
                              top_p=[s["top_p"] for s in part], regex=[s["regex"] for s in part],
                              seed=[(seed, start + j) for j in range(len(part))], **options, **kwargs)
        tokens += result.token_ids[:-1]
        greedy.append(result.token_ids[-1])
        stats.append(result.stats)
    tokens = torch.tensor(tokens)
    return [tokens[i::len(settings)] for i in range(len(settings))], greedy, merge_stats(stats)


def assert_exact(pair, gen, **kwargs) -> list[float]:
    target, _ = pair
    per_setting, greedy, stats = sample(gen, target.tokenizer, **kwargs)
    plain = AutoregressiveGenerator(target).generate([target.tokenizer.encode(PROMPT_TEXT)], max_new_tokens=NEW,
                                                      temperature=0.0, ignore_eos=True).token_ids[0]
    assert all(g == plain for g in greedy)  # a greedy row among sampled ones: the target's own greedy tokens
    assert 0.05 < stats.acceptance_rate < 0.98, stats.acceptance_rate  # drafts were kept, and rejected
    prompt = target.tokenizer.encode(PROMPT_TEXT)
    ps = [p_value(target.model, target.tokenizer, prompt, t, s) for t, s in zip(per_setting, SETTINGS)]
    assert min(ps) > LEVEL, f"chi-square p-values {['%.1e' % p for p in ps]}"
    return ps


def _random_k(monkeypatch, seed):
    from specdecode.policy.choose import AdaptivePolicy

    rng = random.Random(seed)
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, rows, caps: rng.randint(0, max(caps)))


@pytest.mark.slow
@pytest.mark.parametrize("method, k, rejection", [("slem", 3, "leviathan"), ("tli", 2, "chen"),
                                                   ("auto", 3, "leviathan")])
def test_drafts_of_another_tokenizer_follow_the_targets_distribution(pair, method, k, rejection):
    target, draft = pair
    gen = SpeculativeGenerator(target, CrossVocabDrafter(draft, target.tokenizer, method), num_speculative_tokens=k,
                               method=rejection)
    assert_exact(pair, gen)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["auto", "tli"])
def test_seeded_rows_under_a_random_k_follow_the_targets_distribution(pair, monkeypatch, method):
    """Seeded rows under "auto" are Gumbel-coupled: TLI drafts argmax(log q + noise), SLEM (the default method)
    the draft's own greedy text."""
    _random_k(monkeypatch, 5)
    target, draft = pair
    if method == "auto":
        gen = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")  # the generator bridges the two
        assert isinstance(gen.drafter, CrossVocabDrafter)
    else:
        gen = SpeculativeGenerator(target, CrossVocabDrafter(draft, target.tokenizer, method),
                                   num_speculative_tokens="auto")
    assert_exact(pair, gen)


def test_the_check_catches_a_tli_q_that_is_not_what_the_drafts_were_drawn_from(pair, monkeypatch):
    """Power: TLI hands the verifier q before the warping (temperature, top-p) rather than the q it drew from."""
    target, draft = pair
    real = CrossVocabDrafter._tli_position

    def unwarped(self, logits, i, context, chain, previous):
        token, q = real(self, logits, i, context, chain, previous)
        if q is not None:
            q.copy_(torch.softmax(self.bridge.shared.project(logits, self.vocab_size)[context.sampled_index], -1))
        return token, q

    monkeypatch.setattr(CrossVocabDrafter, "_tli_position", unwarped)
    gen = SpeculativeGenerator(target, CrossVocabDrafter(draft, target.tokenizer, "tli"), num_speculative_tokens=3)
    per_setting, _, _ = sample(gen, target.tokenizer, settings=SETTINGS[1:2], rows=1000)
    prompt = target.tokenizer.encode(PROMPT_TEXT)
    assert p_value(target.model, target.tokenizer, prompt, per_setting[0], SETTINGS[1]) < LEVEL


# ---------------------------------------------------------------------------------------------- acceptance
SCRIPT = ("def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    left = [x for x in arr if x < mid]\n"
          "    return quicksort(left) + middle\n")


class ScriptModel:
    """A ModelBackend that knows one text: row b's next token is next_token(its tokens so far), all the weight on it.
    What the loop needs of a backend and no more (forward, trim, reset, select_rows, fork, merge, lengths)."""

    def __init__(self, vocab_size: int, next_token):
        self.vocab_size, self.next_token = vocab_size, next_token
        self.device, self.max_positions = torch.device("cpu"), None
        self.rows: list[list[int]] = []

    def reset(self, batch_size: int) -> None:
        self.rows = [[] for _ in range(batch_size)]

    def forward(self, input_ids, valid=None, last_only=False, output_hidden=False):
        batch, n = input_ids.shape
        logits = torch.full((batch, n, self.vocab_size), -30.0)
        last = [0] * batch
        for b in range(batch):
            for j in range(n):
                if valid is None or valid[b, j]:
                    self.rows[b].append(int(input_ids[b, j]))
                    logits[b, j, self.next_token(self.rows[b])] = 30.0
                    last[b] = j
        return logits[torch.arange(batch), last].unsqueeze(1) if last_only else logits

    def trim(self, lengths) -> None:
        self.rows = [r[:n] for r, n in zip(self.rows, lengths)]

    def select_rows(self, rows) -> None:
        self.rows = [self.rows[r] for r in rows]

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.rows]

    def fork(self, batch_size: int) -> "ScriptModel":
        other = ScriptModel(self.vocab_size, self.next_token)
        other.reset(batch_size)
        return other

    def merge(self, other: "ScriptModel") -> None:
        self.rows += other.rows


def split_tokens(codec: TokenText, ids: list[int], every: int = 4) -> list[int]:
    """ids with every `every`-th word token that two tokens of the vocabulary also spell replaced by those two: a
    target that writes its text otherwise than its tokenizer would, so the draft's text meets a row that ends inside
    one of its tokenizer's tokens (a token straddling the boundary)."""
    by_bytes = {p: i for i, p in enumerate(codec.pieces) if p and codec.kinds[i] == 0}
    out, seen = [], 0
    for t in ids:
        piece = codec.pieces[t]
        cut = next((c for c in range(1, len(piece)) if piece[:c] in by_bytes and piece[c:] in by_bytes
                    and piece.strip().isalpha()), None)
        seen += cut is not None
        out += [by_bytes[piece[:cut]], by_bytes[piece[cut:]]] if cut and seen % every == 0 else [t]
    return out


@pytest.fixture(scope="module")
def script_pair(tokenizer):
    """(target, draft, the target's script): the target writes the script in its tokens, some split otherwise than
    its tokenizer would; the draft reads its own context as text and goes on with the script, in its tokenizer."""
    draft_tok = build_metaspace_tokenizer()
    target_codec, draft_codec = TokenText(tokenizer), TokenText(draft_tok)
    script = split_tokens(target_codec, target_codec.encode(SCRIPT))
    text = SCRIPT.encode()
    off_target, off_draft = target_codec.encode("~")[0], draft_codec.encode("~")[0]

    def target_next(tokens):
        n = len(tokens)
        return script[n] if n < len(script) and tokens == script[:n] else off_target

    def draft_next(tokens):
        read = draft_codec.spell(tokens)
        if not text.startswith(read) or len(read) == len(text):
            return off_draft
        return draft_codec.encode(token_bridge.decodable(text[len(read):]))[0]

    target = LoadedModel(ScriptModel(len(tokenizer), target_next), tokenizer, "script", "")
    draft = LoadedModel(ScriptModel(len(draft_tok), draft_next), draft_tok, "reader", "")
    return target, draft, script


def script_acceptance(script_pair, method: str = "slem", k: int = 4) -> float:
    target, draft, script = script_pair
    prompts = [script[:n] for n in (3, 8, 13, 21)]  # rows that start at different points of the script
    gen = SpeculativeGenerator(target, CrossVocabDrafter(draft, target.tokenizer, method), num_speculative_tokens=k)
    result = gen.generate(prompts, max_new_tokens=24, temperature=0.0, ignore_eos=True)
    assert [p + r for p, r in zip(prompts, result.token_ids)] == [script[:len(p) + 24] for p in prompts]
    return result.stats.acceptance_rate


def test_slem_keeps_the_drafts_of_a_draft_that_knows_the_text(script_pair):
    """Every rejection is at a token the target writes otherwise than its tokenizer would (the script's splits) or
    at a slot the draft's text had not filled: 86 % kept with the boundary handled (the power tests: 58 %)."""
    assert script_acceptance(script_pair) > 0.8


def test_tli_keeps_fewer_of_them(script_pair):
    """TLI drafts the draft's distribution over the shared tokens: its tokens are the draft's tokenization of the
    text, not the target's, so few are kept where the two tokenize differently (22 % here)."""
    assert 0.1 < script_acceptance(script_pair, "tli") < script_acceptance(script_pair)


def test_auto_explores_both_methods_then_keeps_to_the_one_that_kept_more(script_pair):
    """On the script SLEM keeps nearly every draft and TLI few: "auto" tries both for each sampled row, then drafts by
    SLEM (its acceptance near SLEM's, well above TLI's), and its rows' records say what each method kept. (At T = 1:
    the script's models put all their weight on one token, so the rows still write the script.)"""
    from specdecode.drafters.cross_vocab import EXPLORE

    target, draft, script = script_pair
    drafter = CrossVocabDrafter(draft, target.tokenizer, "auto")
    assert drafter.bridge.tli_possible
    prompts = [script[:n] for n in (3, 8, 13, 21)]
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens=4)
    session = gen.session()
    rows = [session.add(gen.request(p, max_new_tokens=40, temperature=1.0, ignore_eos=True, seed=s))
            for s, p in enumerate(prompts)]
    records = []
    while not session.idle:
        session.step()
        records = [r.methods for r in drafter._rows.values()] or records
    result = session.result(rows)
    assert [p + r for p, r in zip(prompts, result.token_ids)] == [script[:len(p) + 40] for p in prompts]
    assert all(r.tried["tli"] >= EXPLORE and r.tried["slem"] > 2 * r.tried["tli"] for r in records)
    assert all(r.share("slem") > r.share("tli") for r in records)
    assert 0 < drafter.counts["tli_rows"] < drafter.counts["slem_rows"] / 2
    assert result.stats.acceptance_rate > script_acceptance(script_pair, "tli") + 0.2


def test_auto_drafts_greedy_rows_by_slem_and_tries_tli_only_on_sampled_ones(script_pair):
    """A greedy row keeps a draft only where it is the target's argmax: "auto" drafts it by SLEM from the first step
    (no trial of TLI, which on the real pairs kept fewer greedy drafts), as "slem" does; a sampled row in the same
    batch still tries both."""
    target, draft, script = script_pair
    drafter = CrossVocabDrafter(draft, target.tokenizer, "auto")
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens=4)
    prompts = [script[:n] for n in (3, 8, 13, 21)]
    greedy = gen.generate(prompts, max_new_tokens=24, temperature=0.0, ignore_eos=True)
    assert [p + r for p, r in zip(prompts, greedy.token_ids)] == [script[:len(p) + 24] for p in prompts]
    assert drafter.counts["tli_rows"] == 0 and drafter.counts["slem_rows"] > 0
    assert greedy.stats.acceptance_rate == pytest.approx(script_acceptance(script_pair, "slem"))
    session = gen.session()
    rows = [session.add(gen.request(prompts[0], max_new_tokens=40, temperature=0.0, ignore_eos=True)),
            session.add(gen.request(prompts[1], max_new_tokens=40, temperature=1.0, ignore_eos=True, seed=3))]
    records = []
    while not session.idle:
        session.step()
        records = records or [r.methods for r in drafter._rows.values()]  # both rows' records (kept up to date)
    assert [p + r for p, r in zip(prompts, session.result(rows).token_ids)] == [script[:len(p) + 40]
                                                                             for p in prompts[:2]]
    assert records[0].tried["tli"] == 0 and records[1].tried["tli"] > 0


def test_a_probe_bounds_the_catch_up_of_a_row_far_behind(script_pair, monkeypatch):
    """A probe after many plain steps feeds the draft only the row's last `catch_up_window` draft tokens, not the
    whole text it missed (the probe's catch-up was most of its cost: 70 tokens of SmolLM2's prefill, 5 target
    steps, on the real pair); greedy output is still the target's own."""
    from specdecode.policy.choose import AdaptivePolicy

    target, draft, script = script_pair
    plan = [2, 2] + [0] * 24 + [3]  # speculate, 24 plain steps, then a probe

    def choose(self, rows, caps):
        self.trial = len(plan) == 1
        return min(plan.pop(0) if plan else 3, max(caps))

    monkeypatch.setattr(AdaptivePolicy, "choose", choose)
    drafter = CrossVocabDrafter(draft, target.tokenizer, "slem")
    drafter.catch_up_window = 6
    held = []
    real = CrossVocabDrafter.propose

    def spy(self, choice, context):
        out = real(self, choice, context)
        held.append((choice.trial, self.backend.lengths[0], len(next(iter(self._rows.values())).bridged.draft.ids)))
        return out

    monkeypatch.setattr(CrossVocabDrafter, "propose", spy)
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens="auto")
    prompt = script[:8]
    result = gen.generate([prompt], max_new_tokens=40, temperature=0.0, ignore_eos=True)
    assert prompt + result.token_ids[0] == script[:48]
    [(trial, length, text)] = [h for h in held if h[0]]
    assert text > 40  # the row's draft ids: the probe's KV would hold them all had it fed everything it missed
    assert length <= 6 + 3 * 3 + 1  # the window, then at most the probe's own drafting forwards


def test_plain_steps_cost_the_draft_no_tokenizing(script_pair, monkeypatch):
    """The adaptive policy asks the drafter's outlook before every step, plain ones too: it must not tokenize the
    row's new text there (0.47 ms of a 65 ms step on the real pair, the 1.5 % that `-k auto` with a draft of another
    tokenizer lost to plain decoding on 2 cores). `behind` counts a token not read yet as one, and the proposal that
    follows reads them all; greedy output stays the target's own."""
    from specdecode.policy.choose import AdaptivePolicy
    from specdecode.text.token_bridge import DraftText

    target, draft, script = script_pair
    plan = [2] + [0] * 12 + [2]  # speculate, 12 plain steps, then speculate again
    seen = []

    def choose(self, rows, caps):
        seen.append(rows[0].behind)
        return min(plan.pop(0) if plan else 0, max(caps))

    monkeypatch.setattr(AdaptivePolicy, "choose", choose)
    adds = []
    real_add = DraftText.add
    monkeypatch.setattr(DraftText, "add", lambda self, new: adds.append(len(seen)) or real_add(self, new))
    gen = SpeculativeGenerator(target, CrossVocabDrafter(draft, target.tokenizer, "slem"),
                               num_speculative_tokens="auto")
    prompt = script[:8]
    result = gen.generate([prompt], max_new_tokens=24, temperature=0.0, ignore_eos=True)
    assert prompt + result.token_ids[0] == script[:32]
    plain = range(3, 14)  # choose() calls 3..13 follow plain steps: nothing proposed since the last read
    assert not [a for a in adds if a in plain]
    assert all(seen[t + 1] == seen[t] + 1 for t in range(2, 13))  # one more unread token a plain step


def test_the_method_record_explores_compares_and_revisits():
    from specdecode.drafters.cross_vocab import EXPLORE, REVISIT, MethodRecord

    record = MethodRecord()
    assert record.choose() == "slem"
    record.record("slem", 1, EXPLORE)  # SLEM keeps 1 in 8
    assert record.choose() == "tli"
    record.record("tli", 6, EXPLORE)  # TLI keeps 6 in 8: the row drafts by TLI from now on
    assert record.choose() == "tli" and record.share("tli") > record.share("slem")
    for _ in range((REVISIT - EXPLORE) // 4 - 1):  # SLEM last used EXPLORE drafts ago
        record.record("tli", 3, 4)
    assert record.choose() == "tli"
    record.record("tli", 3, 4)
    assert record.since["slem"] >= REVISIT and record.choose() == "slem"  # tried again: the text may have turned
    record.record("slem", 4, 4)  # and now SLEM keeps everything (its old record is stale): SLEM again
    assert record.share("slem") > record.share("tli") and record.choose() == "slem"


def _read_window_naively(target, tail_text, new):
    """The proposal taken after as many tokens as the window's text has alone, unchecked."""
    ids = target.encode(token_bridge.decodable(tail_text + new))
    skip = len(target.encode(token_bridge.decodable(tail_text)))
    return ids[skip:], len(ids) - skip - 1, True


def _no_straddle_fallback(target, tail_text, new):
    """Where no tokenization of the window ends at the row's end, the window's tokens are taken anyway."""
    ids = target.encode(token_bridge.decodable(tail_text + new))
    at, start = 0, 0
    while at < len(tail_text) and start < len(ids):
        at, start = at + len(target.pieces[ids[start]]), start + 1
    return ids[start:], len(ids) - start - 1, True


@pytest.mark.parametrize("bug", ["window read naively", "no straddle fallback", "growing token proposed",
                                 "draft KV kept whole"])
def test_the_acceptance_check_catches_a_wrong_boundary(script_pair, monkeypatch, bug):
    """Power: the boundary re-tokenization broken four ways, each caught by the 80 % above (each keeps ~58 %)."""
    if bug == "window read naively":
        monkeypatch.setattr(token_bridge, "spelled_tokens", _read_window_naively)
    elif bug == "no straddle fallback":
        monkeypatch.setattr(token_bridge, "spelled_tokens", _no_straddle_fallback)
    elif bug == "growing token proposed":
        real = token_bridge.BridgedRow.proposal
        monkeypatch.setattr(token_bridge.BridgedRow, "proposal",
                            lambda self, drafted, tail, growing=False: real(self, drafted, tail, True))
    else:  # the draft's KV is never trimmed back to where the row's draft tokens changed
        monkeypatch.setattr(token_bridge.DraftKV, "_keep",
                            lambda self, ids, changed: min(len(self.held), len(ids) - self.base - 1))
    assert script_acceptance(script_pair) < 0.7


# ---------------------------------------------------------------------------------------------- as any draft
def test_a_seeded_row_under_auto_is_the_same_whichever_drafter_proposed(pair, monkeypatch):
    """Coupled rows: the text is a function of the seed (argmax of log p + the row's noise), whatever the drafts."""
    _random_k(monkeypatch, 7)
    target, draft = pair
    prompt = target.tokenizer.encode(PROMPT_TEXT)
    drafters = [CrossVocabDrafter(draft, target.tokenizer, m) for m in ("slem", "tli")] + [PromptLookupDrafter()]
    outputs = {tuple(SpeculativeGenerator(target, d, num_speculative_tokens="auto").generate(
        [prompt], max_new_tokens=12, temperature=0.9, seed=5, ignore_eos=True).token_ids[0]) for d in drafters}
    assert len(outputs) == 1


def test_rows_joining_a_running_batch_equal_their_solo_runs_and_the_prefix_cache_is_used(pair):
    """Continuous batching: rows join mid-run through the drafter's forks; the draft's KV of a finished row's prompt
    (its draft tokens) is parked and lent to a later prompt that starts the same."""
    target, draft = pair
    tok = target.tokenizer
    gen = SpeculativeGenerator(target, CrossVocabDrafter(draft, tok), num_speculative_tokens=3,
                               prefix_cache_tokens=4096)
    prompts = [tok.encode(" arr ar" * 12), tok.encode(" ar arr a r" * 4), tok.encode(" arr ar" * 12 + " rr a")]
    solo = [AutoregressiveGenerator(target).generate([p], max_new_tokens=10, temperature=0.0, ignore_eos=True)
            .token_ids[0] for p in prompts]
    session = gen.session()
    rows = [session.add(gen.request(prompts[0], max_new_tokens=4, temperature=0.0, ignore_eos=True))]
    while not session.idle:  # the first row finishes: its draft KV is parked
        session.step()
    rows = [session.add(gen.request(p, max_new_tokens=10, temperature=0.0, ignore_eos=True)) for p in prompts[:2]]
    session.step()
    rows.append(session.add(gen.request(prompts[2], max_new_tokens=10, temperature=0.0, ignore_eos=True)))
    while not session.idle:
        session.step()
    assert session.result(rows).token_ids == solo
    # the third prompt starts as the first: it takes the first's draft KV (the same prompt again would take all but
    # its last token, too little left to feed for a cold prefill's numbers: ModelDrafter's rule)
    assert gen.drafter.prefix_cache.stats.hit_tokens >= 30


def test_draft_auto_weighs_a_draft_of_another_tokenizer_at_its_own_acceptance(monkeypatch):
    """--draft auto considers SmolLM2 for a built-in target of another family and asks it to pay at the acceptance
    of a draft of another tokenizer (lower than a same-family pair's): costs that would pay at 90 % do not here."""
    import dataclasses

    from specdecode.models import catalog
    from specdecode.pairing import pair
    from specdecode.pairing.draft_choice import CROSS_TOKENIZER_ACCEPTANCE, DraftCosts, choose_draft

    monkeypatch.setattr(catalog, "get_model_info", lambda name: dataclasses.replace(catalog.lookup(name),
                                                                                    installed=True))
    gemma = pair.ModelOptions(target="gemma-3-270m")
    assert pair.auto_draft_model(gemma) == pair.CROSS_TOKENIZER_DRAFT == "smollm2-135m-instruct"
    assert pair.auto_draft_model(pair.ModelOptions(target="smollm2-135m-instruct")) is None  # not itself
    assert pair.auto_draft_model(pair.ModelOptions()) == pair.DEFAULT_DRAFT  # the same tokenizer's draft first
    assert pair.auto_draft_model(pair.ModelOptions(target="/some/dir")) is None
    acceptance = pair.auto_acceptance(gemma, pair.CROSS_TOKENIZER_DRAFT)
    assert acceptance == CROSS_TOKENIZER_ACCEPTANCE < pair.auto_acceptance(pair.ModelOptions(), pair.DEFAULT_DRAFT)
    costs = DraftCosts(0.2, {1: 1.0, 2: 1.6, 3: 1.75, 4: 1.9, 5: 2.05, 7: 2.4, 9: 2.8})
    assert choose_draft("smollm2-135m-instruct", costs).uses_model  # at 90 %: 1.06x
    choice = choose_draft("smollm2-135m-instruct", costs, acceptance=acceptance)
    assert not choice.uses_model and f"at {acceptance:.0%} of drafts kept" in choice.reason


def test_advise_reports_a_draft_of_another_tokenizer(pair):
    """advise times the draft on its own tokens of the prompts and measures its acceptance as any draft model's."""
    from specdecode.bench.advise import advise
    from specdecode.pairing.draft_choice import CROSS_TOKENIZER_ACCEPTANCE

    target, draft = pair
    report = advise(target, draft, [target.tokenizer.encode(PROMPT_TEXT * 3)], max_new_tokens=6, max_k=2,
                    measure="none", cost_repeats=1)
    model = next(d for d in report["drafters"] if d["name"] == "model")
    assert model["proposed_per_position"][0] > 0 and report["costs"]["draft"]["step"] > 0
    assert f"at {CROSS_TOKENIZER_ACCEPTANCE:.0%} of drafts kept" in report["draft_auto"]["text"]


def test_a_draft_of_another_tokenizer_lets_the_policy_settle_where_it_cannot_pay(pair):
    """Every draft it proposes costs the draft model's forwards, so where no K could pay even with every draft kept
    the policy settles and the loop asks it nothing (as for a same-tokenizer draft model); greedy stays plain's."""
    from specdecode.drafters import PromptLookupDrafter as Lookup

    target, draft = pair
    prompt = target.tokenizer.encode(PROMPT_TEXT)
    gen = SpeculativeGenerator(target, CrossVocabDrafter(draft, target.tokenizer), num_speculative_tokens="auto")
    assert gen.drafter.drafts_from_model and not Lookup().drafts_from_model
    rows = [gen.policy.new_row()]
    for _ in range(2):  # timed at a 2-core CPU's costs: c = 0.57, v(2) = 1.62, v(3) = 2.14 target steps
        gen.policy.choose(rows, [8])
        gen.policy.observe(rows, 0, [0], 1, None, 1.0)
        for k, verify in ((1, 1.62), (2, 2.14)):
            gen.policy.choose(rows, [8])
            gen.policy.observe(rows, k, [k], 1, k * 0.57, verify)
    calls = []
    for name in ("outlook", "propose"):
        original = getattr(gen.drafter, name)
        setattr(gen.drafter, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    result = gen.generate([prompt], max_new_tokens=16, temperature=0, ignore_eos=True)
    # it settles at the first step's choice (after the step's one outlook), then nothing more is asked
    assert gen.policy.settled and calls in ([], ["outlook"]) and result.stats.proposed_tokens == 0
    assert result.token_ids == AutoregressiveGenerator(target).generate(
        [prompt], max_new_tokens=16, temperature=0, ignore_eos=True).token_ids
