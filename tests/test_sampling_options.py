"""min_p, logit_bias and the penalties on every path a request takes: greedy speculation equals greedy plain decoding
with each option (model drafts, token trees, prompt lookup, suffix; transformers and llama.cpp), plain greedy with a
repetition penalty or a logit bias equals transformers' own generate(), logprobs are the distribution after the
options, a grammar's masks and the options together, and the CLI's flags."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from reference import assert_matches
from test_penalties_exact import by_formula
from specdecode import AutoregressiveGenerator, PromptLookupDrafter, SpeculativeGenerator

OPTIONS = {  # each option alone (greedy ignores min_p, which never drops the top token), then all of them
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.0),
    "repetition": dict(repetition_penalty=1.4),
    "repetition<1": dict(repetition_penalty=0.8),
    "logit_bias": dict(logit_bias={17: 4.0, 40: -100.0}),
    "min_p": dict(min_p=0.3),
    "all": dict(presence_penalty=-0.5, frequency_penalty=0.7, repetition_penalty=1.2, min_p=0.1,
                logit_bias={17: 2.0}),
}
NEW = 40


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in ("def quicksort(arr):", "The quick brown fox", "import numpy")]


def drafters(draft):
    from specdecode.backends import as_backend
    from specdecode.drafters import ModelDrafter, SuffixDrafter

    return {"model-k3": (draft, 3), "model-auto": (draft, "auto"), "model-tree": (ModelDrafter(as_backend(draft),
            tree_width=3), 4), "prompt-lookup": (PromptLookupDrafter(), 3), "suffix-tree": (SuffixDrafter(
            tree_width=3), 5)}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_greedy_speculation_equals_greedy_plain_decoding(tiny_pair, prompts, name):
    target, draft = tiny_pair
    options = OPTIONS[name]
    plain = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=NEW, temperature=0.0, ignore_eos=True,
                                                     **options)
    if name != "min_p":  # the options do change the greedy text (the test is not about nothing)
        free = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=NEW, temperature=0.0,
                                                        ignore_eos=True)
        assert plain.token_ids != free.token_ids
    for label, (drafter, k) in drafters(draft).items():
        spec = SpeculativeGenerator(target, drafter, num_speculative_tokens=k).generate(
            prompts, max_new_tokens=NEW, temperature=0.0, ignore_eos=True, **options)
        assert spec.token_ids == plain.token_ids, label
        if label == "model-k3":
            assert spec.stats.accepted_tokens > 0


def test_greedy_with_a_repetition_penalty_or_a_logit_bias_is_transformers_own(tiny_pair, prompts):
    """transformers' generate(repetition_penalty=...) and generate(sequence_bias=...) on the same target, token for
    token, plain and speculative."""
    target, draft = tiny_pair
    for options, theirs in [(dict(repetition_penalty=1.3), dict(repetition_penalty=1.3)),
                            (dict(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
                            (dict(logit_bias={17: 3.0, 40: -5.0}), dict(sequence_bias={(17,): 3.0, (40,): -5.0}))]:
        for prompt in prompts:
            ids = torch.tensor([prompt])
            reference = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                        min_new_tokens=NEW, do_sample=False, pad_token_id=0, **theirs)
            expected = reference[0, len(prompt):].tolist()
            for generator in (AutoregressiveGenerator(target), SpeculativeGenerator(target, draft, 3)):
                got = generator.generate([prompt], max_new_tokens=NEW, temperature=0.0, ignore_eos=True, **options)
                assert got.token_ids[0] == expected, (options, type(generator).__name__)


SAMPLED = (0.9, 0, 1.0, dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.05,
                             logit_bias={17: 2.0, 40: -100.0}))


@torch.no_grad()
def test_logprobs_are_the_distribution_after_the_options(tiny_pair, prompts):
    """Each emitted token's logprob (and the top alternatives) equals the log of the formula's distribution at its
    position, for a sampled row and a greedy row (greedy: the log-softmax of the adjusted logits)."""
    target, draft = tiny_pair
    temperature, _, _, options = SAMPLED
    prompt = prompts[0]
    result = SpeculativeGenerator(target, draft, num_speculative_tokens=3).generate(
        [prompt, prompt], max_new_tokens=16, temperature=[temperature, 0.0], seed=4, ignore_eos=True,
        return_logprobs=3, **options)
    assert result.stats.accepted_tokens > 0
    for row, setting in zip(range(2), [SAMPLED, (1.0, 0, 1.0, {**options, "min_p": 0.0})]):
        tokens = torch.tensor(result.token_ids[row])
        logits = target(torch.tensor([prompt + tokens.tolist()])).logits[0, len(prompt) - 1: -1]
        hot = torch.nn.functional.one_hot(tokens, logits.shape[-1]).double()
        law = by_formula(logits, prompt, hot.cumsum(0) - hot, setting).log()
        assert result.logprobs[row] == pytest.approx(law.gather(1, tokens[:, None]).squeeze(1).tolist(), abs=1e-4)
        for top, position in zip(result.top_logprobs[row], law):
            assert [t for t, _ in top] == position.topk(3).indices.tolist()


@torch.no_grad()
def test_a_grammar_and_the_options_together(tiny_pair, tokenizer, prompts):
    """Under a regex, the samples follow normalise(formula(p) x mask), enumerated; greedy under a JSON schema is
    the same with speculation on and off."""
    from specdecode.structured.constraints import ConstraintSpec, GrammarCompiler

    target, draft = tiny_pair
    regex, prompt = "[abc]{2}[de][abc]", prompts[1]
    setting = (1.0, 0, 1.0, dict(presence_penalty=2.0, repetition_penalty=1.5, logit_bias={17: 1.0}))
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    grammar = GrammarCompiler.for_tokenizer(tokenizer, len(tokenizer), eos_token_ids=[eos]).compile(
        ConstraintSpec.of(regex=regex))
    law = {(): 1.0}
    for _ in range(3):
        grown = {}
        for prefix, mass in law.items():
            matcher = grammar.matcher()
            assert matcher.advance(list(prefix)) == len(prefix)
            logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1:]
            counts = torch.zeros(1, logits.shape[-1], dtype=torch.float64)
            for t in prefix:
                counts[0, t] += 1
            p = by_formula(logits, prompt, counts, setting)[0] * matcher.mask()
            p = p / p.sum()
            grown.update({prefix + (t,): mass * p[t].item() for t in p.nonzero().flatten().tolist()})
        law = grown
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3, tokenizer=tokenizer)
    result = generator.generate([prompt] * 3000, max_new_tokens=3, temperature=1.0, seed=8, regex=regex,
                                ignore_eos=True, **setting[3])
    index = {s: i for i, s in enumerate(law)}
    observed = torch.zeros(len(law) + 1)
    for row in result.token_ids:
        observed[index.get(tuple(row), len(law))] += 1
    assert_matches(observed, list(law.values()) + [0.0], min_p=1e-3)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
              "required": ["ok", "color"], "additionalProperties": False}
    options = dict(repetition_penalty=1.3, presence_penalty=0.5)
    plain = AutoregressiveGenerator(target, tokenizer=tokenizer).generate(
        [prompt], max_new_tokens=60, temperature=0.0, json_schema=schema, **options)
    spec = generator.generate([prompt], max_new_tokens=60, temperature=0.0, json_schema=schema, **options)
    assert spec.token_ids == plain.token_ids and json.loads(plain.texts[0])["color"] in ("red", "green")


def test_bad_values_and_token_ids_outside_the_vocabulary_are_refused(tiny_pair):
    target, _ = tiny_pair
    generator = AutoregressiveGenerator(target)
    with pytest.raises(ValueError, match=r"logit_bias has token ids outside the vocabulary \[0, 320\): \[320\]"):
        generator.generate([[1, 2]], max_new_tokens=2, logit_bias={320: 1.0})
    with pytest.raises(ValueError, match="min_p must be in"):
        generator.generate([[1, 2]], max_new_tokens=2, min_p=2.0)
    with pytest.raises(ValueError, match="repetition_penalty has 3 entries for 1 prompts"):
        generator.generate([[1, 2]], max_new_tokens=2, repetition_penalty=[1.1, 1.2, 1.3])


# ---------------------------------------------------------------------------------------------- llama.cpp
@pytest.mark.parametrize("name", ["repetition", "presence", "logit_bias", "all"])
def test_llamacpp_greedy_speculation_equals_greedy_plain_decoding(smol_path, name):
    llama_cpp = pytest.importorskip("llama_cpp")
    from specdecode.backends.llamacpp import LlamaCppBackend

    def backend(**options):  # the exact mode: every forward is token-by-token's numbers
        return LlamaCppBackend(smol_path, n_ctx=256, n_threads=1, max_tokens_per_forward=3, **options)

    options = OPTIONS[name]
    vocab = llama_cpp.Llama(str(smol_path), vocab_only=True, verbose=False)
    prompt = vocab.tokenize(b"def add(a, b):\n    return a + b\n\ndef add3(a, b, c):")
    plain = AutoregressiveGenerator(backend()).generate([prompt], max_new_tokens=32, temperature=0.0,
                                                        ignore_eos=True, **options)
    for drafter, k in [(PromptLookupDrafter(), 3), (LlamaCppBackend(smol_path, n_ctx=256, n_threads=1), 4)]:
        spec = SpeculativeGenerator(backend(), drafter, num_speculative_tokens=k).generate(
            [prompt], max_new_tokens=32, temperature=0.0, ignore_eos=True, **options)
        assert spec.token_ids == plain.token_ids, type(drafter).__name__
    assert spec.stats.target_forward_calls < 32  # the draft model's drafts were kept: it did speculate


@torch.no_grad()
def test_llamacpp_samples_follow_the_formulas(tmp_path):
    """A tiny random GGUF (near-uniform logits: the penalties move a lot) with a draft that has its own q: the first
    three tokens' joint under top-k 3 and the options, enumerated from the backend's own logits."""
    pytest.importorskip("llama_cpp")
    from test_llamacpp import BiasedBackend, token_by_token
    from test_registry import write_tiny_gguf

    from specdecode.backends.llamacpp import LlamaCppBackend

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    prompt, rows = [5, 77, 140, 77], 250
    setting = (1.0, 3, 1.0, dict(presence_penalty=2.0, repetition_penalty=1.5, logit_bias={5: 0.8}))
    reference = LlamaCppBackend(path, n_ctx=64, n_threads=1)
    law = {(): 1.0}
    for _ in range(3):
        grown = {}
        for prefix, mass in law.items():
            logits = token_by_token(reference, prompt, [*prefix, 0])[-1][None]
            counts = torch.zeros(1, logits.shape[-1], dtype=torch.float64)
            for t in prefix:
                counts[0, t] += 1
            cond = by_formula(logits, prompt, counts, setting)[0]
            grown.update({(*prefix, t): mass * cond[t].item() for t in cond.nonzero().flatten().tolist()})
        law = grown
    target = LlamaCppBackend(path, n_ctx=64, n_threads=1, max_rows=rows, max_tokens_per_forward=3)
    draft = BiasedBackend(LlamaCppBackend(path, n_ctx=64, n_threads=1, max_rows=rows), 1.0, seed=3)
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    index, observed, accepted, proposed = {s: i for i, s in enumerate(law)}, torch.zeros(len(law) + 1), 0, 0
    for call in range(12):
        result = generator.generate([prompt] * rows, max_new_tokens=4, temperature=1.0, top_k=3,
                                    seed=[(5, call * rows + j) for j in range(rows)], ignore_eos=True, **setting[3])
        for tokens in result.token_ids:
            observed[index.get(tuple(tokens[:3]), len(law))] += 1
        accepted, proposed = accepted + result.stats.accepted_tokens, proposed + result.stats.proposed_tokens
    assert 0.05 < accepted / proposed < 0.95
    assert_matches(observed, list(law.values()) + [0.0], min_p=1e-3)


# ---------------------------------------------------------------------------------------------- the CLI
def test_the_cli_takes_each_option_and_words_bad_values_with_its_flag(tiny_model_dirs):
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    base = ["generate", "def f(x):", "--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"],
            "--draft-quantize", "none", "-k", "3", "-n", "12", "--json", "--ignore-eos"]
    runner = CliRunner()
    plain = json.loads(runner.invoke(app, base).stdout)
    flags = ["--repetition-penalty", "1.5", "--presence-penalty", "1", "--frequency-penalty", "0.5",
             "--logit-bias", "17:3,40:-100"]
    penalised = runner.invoke(app, base + flags)
    assert penalised.exit_code == 0, penalised.output
    record = json.loads(penalised.stdout)
    assert record["token_ids"] != plain["token_ids"]
    from specdecode import load_model

    model = load_model(tiny_model_dirs["target"])
    expected = AutoregressiveGenerator(model).generate("def f(x):", max_new_tokens=12, temperature=0.0,
                                                       ignore_eos=True, repetition_penalty=1.5, presence_penalty=1,
                                                       frequency_penalty=0.5, logit_bias={17: 3, 40: -100})
    assert record["token_ids"] == expected.token_ids[0]
    # --min-p warps a draw: taken when sampling, refused at temperature 0 (greedy reads none of it: cli/applies.py)
    sampled = runner.invoke(app, base + ["--temperature", "0.8", "--seed", "1", "--min-p", "0.1"])
    assert sampled.exit_code == 0, sampled.output
    greedy = runner.invoke(app, base + ["--min-p", "0.1"])
    assert greedy.exit_code == 1 and "--min-p 0.1 does nothing at temperature 0" in greedy.output
    for bad, message in [(["--presence-penalty", "3"], "--presence-penalty must be a number in [-2, 2]"),
                         (["--repetition-penalty", "0"], "--repetition-penalty must be a number > 0"),
                         (["--min-p", "1.5"], "--min-p must be in [0, 1]"),
                         (["--logit-bias", "17=3"], "--logit-bias takes TOKEN_ID:VALUE pairs"),
                         (["--logit-bias", "17:500"], "--logit-bias values must be numbers in [-100, 100]"),
                         (["--logit-bias", "99999:1"], "--logit-bias has token ids outside the vocabulary")]:
        out = runner.invoke(app, base + bad)
        assert out.exit_code != 0 and message in " ".join(out.output.split()), (bad, out.output)


# ---------------------------------------------------------------------------------------------- verify
def test_verify_checks_the_options_and_fails_a_loop_that_drops_them(tiny_pair, tokenizer, monkeypatch):
    """`specdecode verify`'s reference applies the options along each prefix: the speculative samples pass it, and a
    loop whose verified positions ignore the penalties fails it."""
    from specdecode.evals.verify import verify_pair
    from specdecode.exact.penalties import RowPenalties
    from specdecode.exact.sampling import SamplingParams

    params = SamplingParams(1.0, 3, presence_penalty=2.0, repetition_penalty=2.0, min_p=0.05)
    prompt = tokenizer("def quicksort(arr):\n")["input_ids"]
    generator = SpeculativeGenerator(*tiny_pair, num_speculative_tokens=2, tokenizer=tokenizer)
    report = verify_pair(generator, [prompt], params, positions=4, samples=1500, batch_size=250, seed=11)
    assert report["pass"] and report["sampling"]["presence_penalty"] == 2.0
    monkeypatch.setattr(RowPenalties, "along_chain", lambda self, tokens: None)  # p without the options
    report = verify_pair(generator, [prompt], params, positions=4, samples=1500, batch_size=250, seed=11)
    assert not report["pass"]


def test_the_verify_command_takes_the_options(tiny_model_dirs, tmp_path):
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    path = tmp_path / "verify.json"
    result = CliRunner().invoke(app, ["verify", "--target", tiny_model_dirs["target"], "--draft",
                                      tiny_model_dirs["draft"], "--draft-quantize", "none", "-k", "2", "--samples",
                                      "400", "--positions", "3", "--batch-size", "200", "--nb-prompts", "1",
                                      "--repetition-penalty", "1.5", "--logit-bias", "17:2", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "repetition_penalty 1.5, logit_bias on 1 token(s)" in " ".join(result.stdout.split())
    report = json.loads(path.read_text())
    assert report["pass"] and report["sampling"]["logit_bias"] == {"17": 2.0}
