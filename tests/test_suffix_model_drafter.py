"""suffix+MODEL: per row and step the suffix's copy or the model's draft, and the output exactly the target's.

Greedy token for token (fixed K, auto, rows joining a running batch); sampled by chi-square against the enumerated
joint with rows of both sources in one step; no model forward on a step where every row copies, and that step
priced free; the model kept in step with tokens it did not draft (a draft identical to the target then has every
draft kept); and the --draft suffix+MODEL option.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import build_tokenizer, perturbed_copy, tiny_qwen
from drafting import Driver
from reference import assert_matches, exact_joint, hf_warp
from specdecode import AutoregressiveGenerator, LoadedModel, SpeculativeGenerator, SuffixModelDrafter
from specdecode.errors import OptionError
from specdecode.models.sources import ModelNotFoundError
from specdecode.pairing.pair import ModelOptions, check_options, load_pair, make_generator
from specdecode.policy.choose import AdaptivePolicy
from specdecode.exact.sampling import BatchSampling, SamplingParams

TEXTS = ["def quicksort(arr):\n    if len(arr) <= 1:\n        return arr", "The quick brown fox",
         "import numpy as np\nfor i in range(10):"]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def plain(tiny_pair, prompts):
    """The target's own greedy decoding of the prompts."""
    return AutoregressiveGenerator(tiny_pair[0]).generate(prompts, max_new_tokens=48, temperature=0.0,
                                                          ignore_eos=True).token_ids


class StepLog:
    """Wraps a drafter's propose and observe: per step, whether it was free and how many drafts each source had."""

    def __init__(self, drafter: SuffixModelDrafter):
        self.drafter, self.steps = drafter, []
        propose, observe = drafter.propose, drafter.observe

        def logged_propose(*args, **kwargs):
            proposal = propose(*args, **kwargs)
            self.steps.append({"free": proposal.free, "proposal": proposal})
            return proposal

        def logged_observe(outcome):
            before = dataclasses.replace(drafter.counts)
            observe(outcome)
            if self.steps and "suffix" not in self.steps[-1]:
                self.steps[-1]["suffix"] = drafter.counts.suffix_drafts - before.suffix_drafts
                self.steps[-1]["model"] = drafter.counts.model_drafts - before.model_drafts

        drafter.propose, drafter.observe = logged_propose, logged_observe

    @property
    def kinds(self) -> str:
        return "".join("F" if s["free"] else "M" for s in self.steps)


# ---------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_output_is_the_targets_own(tiny_pair, prompts, plain, k):
    target, draft = tiny_pair
    drafter = SuffixModelDrafter(draft)
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens=k)
    for _ in range(2):  # the second time the suffix's history holds both answers: it drafts nearly everything
        result = gen.generate(prompts[:2], max_new_tokens=48, temperature=0.0, ignore_eos=True)
        assert result.token_ids == plain[:2]
    if k != "auto":  # the policy may decode plainly where drafts do not pay; a fixed K drafts whenever it can
        counts = drafter.counts
        assert counts.suffix_drafts > 0 and counts.model_drafts > 0 and counts.free_steps > 0
        assert result.stats.proposed_tokens > 0


def test_rows_joining_a_running_batch_keep_both_drafters_in_step(tiny_pair, prompts, plain):
    """Continuous batching (what the server runs): rows join and leave through the session's row changes
    (relayout); with a draft identical to the target every model draft is kept, so the model never lags."""
    target, _ = tiny_pair
    drafter = SuffixModelDrafter(copy.deepcopy(target))
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens=3)
    session = gen.session(max_batch=2)  # the third row joins when the first leaves
    for prompt, n in zip(prompts, [20, 48, 48]):
        session.add(gen.request(prompt, n, temperature=0.0, ignore_eos=True))
    while not session.idle:
        session.step()
    tokens = session.result().token_ids
    assert tokens == [plain[0][:20], plain[1], plain[2]]
    counts = drafter.counts
    assert counts.suffix_drafts > 0 and counts.model_drafts > 0
    assert counts.model_kept == counts.model_drafts


# ---------------------------------------------------------------------------------------------- the model in step
@pytest.mark.parametrize("rows", [[0], [0, 1]])
def test_the_model_keeps_in_step_with_tokens_it_did_not_draft(tiny_pair, prompts, plain, rows):
    """A draft identical to the target proposes the target's greedy tokens as long as its cache holds exactly the
    row's text: every model draft is kept only if the model caught up on what the suffix drafted before. One row
    switches between free steps and model steps; two rows also mix sources within a step."""
    target, _ = tiny_pair
    drafter = SuffixModelDrafter(copy.deepcopy(target))
    log = StepLog(drafter)
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens=3)
    result = gen.generate([prompts[r] for r in rows], max_new_tokens=48, temperature=0.0, ignore_eos=True)
    assert result.token_ids == [plain[r] for r in rows]
    counts = drafter.counts
    assert counts.model_drafts > 0 and counts.model_kept == counts.model_drafts
    assert counts.suffix_drafts > 0
    if len(rows) == 1:
        assert "FM" in log.kinds  # the model drafted again after a step it did not run
    else:
        assert any(s["suffix"] and s["model"] for s in log.steps)  # both sources in one step


# ---------------------------------------------------------------------------------------------- free steps
LOOP = [5, 6, 7, 8] * 4


def test_a_step_where_every_row_copies_runs_no_model_forward(tiny_pair):
    _, draft = tiny_pair
    drafter = SuffixModelDrafter(draft)
    rows = Driver(drafter)
    rows.join([LOOP, LOOP[1:] + [5]])
    rows.observe([[5], [6]])  # the model is lazy: it has fed nothing yet
    outlook = rows.outlook(3)
    assert outlook.drafts == [3, 3]
    assert outlook.free and outlook.behind == [0, 0]  # no forward this step: nothing to catch up on
    calls = drafter.forward_calls
    sampling = BatchSampling([SamplingParams(1.0), SamplingParams(1.0)])
    proposal = rows.propose(3, [3, 3], sampling, torch.rand(2, 3, dtype=torch.float64))
    assert drafter.forward_calls == calls
    assert proposal.free and proposal.q is None  # deterministic drafts only
    assert proposal.tokens.tolist() == [[6, 7, 8], [7, 8, 5]]


NOVEL = [9, 10, 11, 12]  # nothing to copy


def model_behind(drafter: SuffixModelDrafter, rows: Driver) -> list[int]:
    """The model's backlog per row (the tokens of each row's text its cache lacks)."""
    return rows.part(drafter.model_drafter).outlook(3).behind


def mixed_step(draft):
    """A drafter whose first row copies (LOOP) and second takes the model, after one proposal of 3 drafts."""
    drafter = SuffixModelDrafter(draft)
    rows = Driver(drafter)
    rows.join([LOOP, NOVEL])
    rows.observe([[5], [13]])
    outlook = rows.outlook(3)
    assert outlook.drafts == [3, 3]
    assert not outlook.free and outlook.behind == [17, 5]  # the model's backlog: prompt + first token
    calls = drafter.forward_calls
    sampling = BatchSampling([SamplingParams(1.0), SamplingParams(0.8)])
    uniforms = torch.rand(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    proposal = rows.propose(3, [3, 3], sampling, uniforms)
    assert drafter.forward_calls > calls and not proposal.free
    return drafter, rows, proposal


def test_a_mixed_step_gives_the_copied_rows_one_hot_q(tiny_pair):
    drafter, rows, proposal = mixed_step(tiny_pair[1])
    assert proposal.tokens[0].tolist() == [6, 7, 8]
    q = proposal.q
    assert q.shape == (2, 3, drafter.vocab_size)
    assert torch.equal(q[0], torch.nn.functional.one_hot(proposal.tokens[0], q.shape[-1]).to(q.dtype))
    assert ((q[1] > 0).sum(-1) > 1).all() and torch.allclose(q[1].sum(-1), torch.ones(3))  # the model's own
    rows.observe([[6, 7, 8, 5], [proposal.tokens[1, 0].item(), 1]], [3, 1])
    assert drafter.counts.suffix_kept == 3 and drafter.counts.model_kept == 1
    # Whatever the model drew for the copied row, its cache and backlog hold each row's text, no more, no less.
    held = drafter.model_drafter.backend.lengths
    assert [n + b for n, b in zip(held, model_behind(drafter, rows))] == [16 + 1 + 4, 4 + 1 + 2]
    assert model_behind(drafter, rows)[1] == 1  # the model row: only the token after its kept draft


def test_the_model_drafts_from_the_copied_rows_text_after_a_mixed_step(tiny_pair):
    """After a step whose first row's drafts the suffix made and the target kept, the model's next distribution
    for that row is a fresh model's on the row's whole text: its cache holds the emitted tokens, not its own
    (sampled) drafts for the row."""
    from specdecode.drafters import ModelDrafter

    _, draft = tiny_pair
    drafter, rows, proposal = mixed_step(draft)
    second = proposal.tokens[1, 0].item()
    rows.observe([[6, 7, 8, 5], [second, 1]], [3, 1])
    texts = [LOOP + [5, 6, 7, 8, 5], NOVEL + [13, second, 1]]
    fresh = Driver(ModelDrafter(drafter.model_drafter.backend.fork(2)))
    fresh.join(texts)
    sampling = BatchSampling([SamplingParams(1.0), SamplingParams(1.0)])
    uniforms = torch.full((2, 3), 0.5, dtype=torch.float64)
    q = rows.part(drafter.model_drafter).propose(3, [3, 3], sampling, uniforms).q
    expected = fresh.propose(3, [3, 3], sampling, uniforms).q
    assert torch.allclose(q[:, 0], expected[:, 0], atol=1e-5)


def test_a_free_step_is_priced_free_and_teaches_no_draft_cost():
    policy = AdaptivePolicy(4)
    rows = [policy.new_row()]
    policy.observe(rows, 0, [0], 1, 0.0, 0.10)
    policy.observe(rows, 2, [1], 1, 0.20, 0.12)  # a model step: 100 ms per draft
    assert policy.draft_cost(1) == pytest.approx(0.10)
    priced = policy.step_time(2, 1)
    assert policy.step_time(2, 1, free=True) == pytest.approx(priced - 0.20)  # the verification alone
    policy.observe(rows, 2, [2], 1, 0.0002, 0.12, free=True)  # a free step's 0.1 ms per draft is not the model's cost
    assert policy.draft_cost(1) == pytest.approx(0.10)
    assert policy.step_time(2, 1, free=False) == pytest.approx(priced)


@pytest.mark.parametrize("k", [3, "auto"])
def test_a_repeated_request_drafts_without_the_model_and_its_cost_is_not_learned(tiny_pair, prompts, plain, k):
    """The second time, the suffix's history holds the answer: every step copies, no model forward runs, the
    policy's model draft cost stays what the first run measured, and auto speculates although the tiny draft
    model costs as much as the target (its drafts are priced free)."""
    target, draft = tiny_pair
    gen = SpeculativeGenerator(target, SuffixModelDrafter(draft), num_speculative_tokens=k)
    gen.generate(prompts[2], max_new_tokens=32, temperature=0.0, ignore_eos=True)
    learned = gen.policy.summary()["costs"]
    warm = gen.generate(prompts[2], max_new_tokens=32, temperature=0.0, ignore_eos=True)
    assert warm.token_ids[0] == plain[2][:32]
    assert warm.stats.draft_forward_calls == 0 and warm.stats.proposed_tokens > 10
    assert {b: c["draft_s"] for b, c in gen.policy.summary()["costs"].items()} == \
        {b: c["draft_s"] for b, c in learned.items()}


# ---------------------------------------------------------------------------------------------- sampled
VOCAB = 16
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # a row whose first token continues the pattern copies; the others take the model
SAMPLES = 4000


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_qwen(VOCAB, seed=10, layers=2, hidden=32)
    return target, perturbed_copy(target, 0.3, seed=11)


@pytest.mark.parametrize("k, method, seed", [(3, "leviathan", 1), (2, "chen", 2)])
def test_sampled_output_follows_the_target_exactly(small_pair, k, method, seed):
    """The first three tokens' joint against the target's, enumerated, with copied and model rows in the same
    steps (the copied rows' q one-hot, the model rows' their own)."""
    target, draft = small_pair
    drafter = SuffixModelDrafter(draft)
    log = StepLog(drafter)
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens=k, method=method)
    result = gen.generate([PROMPT] * SAMPLES, max_new_tokens=k + 2, temperature=0.8, seed=seed, ignore_eos=True)
    mixed = [s for s in log.steps if s["suffix"] and s["model"]]
    assert mixed and all(s["proposal"].q is not None for s in mixed)
    q = mixed[0]["proposal"].q
    one_hot = (q.max(dim=-1).values == 1.0).all(dim=-1)
    assert one_hot.any() and not one_hot.all()  # copied rows beside the model's, in one q
    assert 0.05 < result.stats.acceptance_rate < 0.98  # both the accept and the reject paths ran
    joint = exact_joint(target, PROMPT, 3, functools.partial(hf_warp, temperature=0.8, top_k=0, top_p=1.0))
    index = {s: i for i, s in enumerate(joint)}
    observed = torch.zeros(len(joint) + 1)
    for row in result.token_ids:
        observed[index.get(tuple(row[:3]), len(joint))] += 1
    assert_matches(observed, list(joint.values()) + [0.0], min_p=1e-4)


def test_structured_output_with_both_sources(tiny_pair, tokenizer):
    """Under a JSON schema the grammar's forced runs replace drafts of either source (one-hot where q is dense);
    greedy stays the target's own, and sampled answers keep to the schema."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 24}},
              "required": ["ok", "name"], "additionalProperties": False}
    target, draft = tiny_pair
    prompt = tokenizer("The quick brown fox")["input_ids"]
    plain = AutoregressiveGenerator(target, tokenizer=tokenizer).generate(
        [prompt], max_new_tokens=60, temperature=0.0, json_schema=schema).token_ids
    drafter = SuffixModelDrafter(draft)
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens=3, tokenizer=tokenizer)
    for _ in range(2):  # the second time the suffix knows the answer
        assert gen.generate([prompt], max_new_tokens=60, temperature=0.0, json_schema=schema).token_ids == plain
    sampled = gen.generate([prompt] * 16, max_new_tokens=60, temperature=1.0, seed=3, json_schema=schema)
    assert all(len(json.loads(text)["name"]) <= 24 for text in sampled.texts)
    assert drafter.counts.suffix_drafts > 0 and drafter.counts.model_drafts > 0


# ---------------------------------------------------------------------------------------------- options
def test_the_option_names_the_draft_model_after_suffix_plus(tiny_model_dirs, prompts):
    name = ModelOptions(draft="suffix+qwen2.5-coder-0.5b-instruct")
    assert name.draft_with_suffix and not name.draft_is_lookup and name.draft_model == "qwen2.5-coder-0.5b-instruct"
    assert ModelOptions(draft="suffix").draft_model is None and ModelOptions(draft="none").draft_model is None
    opts = ModelOptions(target=tiny_model_dirs["target"], draft=f"Suffix+{tiny_model_dirs['draft']}",
                        suffix_history_tokens=123, draft_quantize="none")
    target, drafter = load_pair(opts)
    assert isinstance(drafter, SuffixModelDrafter) and drafter.suffix.history.max_tokens == 123
    expected = make_generator(target, None).generate(prompts[:2], max_new_tokens=32, temperature=0.0,
                                                      ignore_eos=True).token_ids
    gen = make_generator(target, drafter, 3)
    assert gen.generate(prompts[:2], max_new_tokens=32, temperature=0.0, ignore_eos=True).token_ids == expected
    assert drafter.counts.suffix_drafts + drafter.counts.model_drafts > 0


@pytest.mark.parametrize("draft", ["suffix+", "suffix+ ", "suffix+none", "suffix+suffix", "suffix+Prompt-Lookup",
                                   "suffix+suffix+x"])
def test_suffix_plus_needs_a_model(tiny_model_dirs, draft):
    with pytest.raises(OptionError, match="needs a draft model after 'suffix\\+'") as error:
        check_options(ModelOptions(target=tiny_model_dirs["target"], draft=draft))
    assert error.value.option == "draft" and str(error.value).startswith("draft ")


def test_an_unknown_model_after_suffix_plus_is_named(tiny_model_dirs):
    with pytest.raises(ModelNotFoundError, match="'no-such-model' not found"):
        check_options(ModelOptions(target=tiny_model_dirs["target"], draft="suffix+no-such-model"))


def test_a_draft_model_of_another_tokenizer_drafts_through_its_text(tiny_pair, tokenizer):
    from specdecode.drafters import CrossVocabDrafter

    target, draft = tiny_pair
    other = build_tokenizer(vocab_size=300)
    gen = SpeculativeGenerator(LoadedModel(target, tokenizer, "t", "t"),
                               SuffixModelDrafter(LoadedModel(draft, other, "d", "d")), num_speculative_tokens=2)
    assert isinstance(gen.drafter.model_drafter, CrossVocabDrafter)  # suffix+MODEL's MODEL, bridged
    prompt = tokenizer("def quicksort(arr):")["input_ids"]
    plain = AutoregressiveGenerator(target).generate([prompt], max_new_tokens=8, temperature=0.0, ignore_eos=True)
    assert gen.generate([prompt], max_new_tokens=8, temperature=0.0, ignore_eos=True).token_ids == plain.token_ids
    same = SuffixModelDrafter(LoadedModel(draft, tokenizer, "d", "d"))
    assert same.vocab_size == len(tokenizer) and same.model_tokenizer is tokenizer
    with pytest.raises(ValueError, match="min_score"):
        SuffixModelDrafter(draft, min_score=0)


def test_the_cli_generates_with_suffix_plus_a_model_and_equals_plain_decoding(tiny_model_dirs):
    from specdecode.cli.app import app

    def run(*args):
        return CliRunner().invoke(app, [*args, "--target", tiny_model_dirs["target"]])

    generate = ["generate", "def quicksort(arr):\n    return quicksort(arr)", "-n", "16", "--ignore-eos", "--json"]
    combined = run(*generate, "--draft", f"suffix+{tiny_model_dirs['draft']}", "-k", "3")
    assert combined.exit_code == 0 and combined.exception is None, combined.output
    plain = run(*generate, "--draft", "none")
    assert json.loads(combined.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert json.loads(combined.stdout)["stats"]["proposed_tokens"] > 0
    for command in (["generate", "x"], ["serve"]):
        bad = run(*command, "--draft", "suffix+")
        assert bad.exit_code != 0 and "--draft 'suffix+' needs a draft model" in bad.output, bad.output
