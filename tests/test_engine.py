"""The decoding loop's contract: stopping, streaming, statistics, seeds, vocabularies and bad input."""

import copy
import functools
import itertools

import pytest
import torch

from specdecode.exact import sampling
from specdecode.exact.sampling import RowGenerators, stream_seed

from conftest import perturbed_copy, tiny_qwen
from specdecode import AutoregressiveGenerator, SpeculativeGenerator, VocabularyMismatchError, load_model

PROMPT = [11, 42, 7, 99, 5]


def hf_greedy(model, prompt, new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen(128, seed=3, eos_token_id=127)
    return target, perturbed_copy(target, 0.3, seed=4)


# ---------------------------------------------------------------------------------------------- acceptance
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_draft_identical_to_target_accepts_everything(models, temperature):
    target, _ = models
    result = SpeculativeGenerator(target, copy.deepcopy(target), num_speculative_tokens=4).generate(
        [PROMPT, [3, 4]], max_new_tokens=40, temperature=temperature, top_k=20 if temperature == 0.7 else 0,
        seed=0, ignore_eos=True)
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.accepted_per_position == result.stats.proposed_per_position
    # every step emits K accepted tokens + 1 bonus, except the last, which is shortened to fit max_new_tokens
    assert result.stats.mean_accepted_length > 4.0
    assert {"accepted", "bonus"} >= set(result.provenance[0][1:])


# ------------------------------------------------------------------------------------------------ stopping
@pytest.mark.parametrize("new_tokens", [1, 2, 3, 7, 11])
@pytest.mark.parametrize("k", [4, 8])
def test_stops_exactly_at_max_new_tokens(models, new_tokens, k):
    target, draft = models
    result = SpeculativeGenerator(target, draft, num_speculative_tokens=k).generate(
        [PROMPT, [9]], max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    assert [len(t) for t in result.token_ids] == [new_tokens, new_tokens]
    assert result.token_ids[0] == hf_greedy(target, PROMPT, new_tokens)
    assert result.finish_reasons == ["length", "length"]
    assert result.stats.new_tokens == 2 * new_tokens


def test_one_token_prompt(models):
    target, draft = models
    result = SpeculativeGenerator(target, draft, num_speculative_tokens=3).generate(
        [[17]], max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert result.token_ids[0] == hf_greedy(target, [17], 12)


def test_eos_inside_an_accepted_run_ends_the_row_there(models):
    target, _ = models
    reference = hf_greedy(target, PROMPT, 12)
    eos = reference[3]
    first = reference.index(eos)
    target_with_eos = copy.deepcopy(target)
    target_with_eos.generation_config.eos_token_id = eos
    generator = SpeculativeGenerator(target_with_eos, copy.deepcopy(target_with_eos), num_speculative_tokens=8)
    result = generator.generate(PROMPT, max_new_tokens=12, temperature=0.0)
    assert result.token_ids[0] == reference[: first + 1]  # EOS included, nothing after it
    assert result.finish_reasons == ["stop"]
    assert result.provenance[0][first] == "accepted"  # it came from inside the drafted run
    assert generator.generate(PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True).token_ids[0] == reference


def test_stop_token_ids_and_ragged_max_new_tokens(models):
    target, draft = models
    reference = hf_greedy(target, PROMPT, 10)
    result = SpeculativeGenerator(target, draft, num_speculative_tokens=3).generate(
        [PROMPT, PROMPT], max_new_tokens=[10, 4], temperature=0.0, ignore_eos=True, stop_token_ids=[reference[5]])
    stop = reference.index(reference[5])
    assert result.token_ids[0] == reference[: stop + 1]
    assert result.token_ids[1] == reference[:4]
    assert result.finish_reasons == ["stop" if stop < 10 else "length", "length"]


def test_finished_rows_stop_costing_work(models):
    target, draft = models
    result = SpeculativeGenerator(target, draft, num_speculative_tokens=2).generate(
        [PROMPT, PROMPT, [1, 2]], max_new_tokens=[2, 2, 40], temperature=0.0, ignore_eos=True)
    steps = result.stats.target_forward_calls - 1  # minus the prefill
    # rows 0 and 1 need one verification step each; only row 2 runs for the remaining steps
    assert result.stats.verification_steps == steps + 2
    assert [len(t) for t in result.token_ids] == [2, 2, 40]


def test_token_id_zero_is_a_valid_token(models):
    target, draft = models
    zero_loving = copy.deepcopy(target)
    with torch.no_grad():
        zero_loving.lm_head.weight[0] = zero_loving.lm_head.weight[PROMPT[-1]] * 0.5 + zero_loving.lm_head.weight[0]
        zero_loving.lm_head.bias = None
        zero_loving.lm_head.weight[0] += 3 * zero_loving.model.norm.weight.sign()
    reference = hf_greedy(zero_loving, PROMPT, 16)
    assert 0 in reference
    result = SpeculativeGenerator(zero_loving, draft, num_speculative_tokens=4).generate(
        PROMPT, max_new_tokens=16, temperature=0.0, ignore_eos=True)
    assert result.token_ids[0] == reference
    sampled = SpeculativeGenerator(zero_loving, draft, num_speculative_tokens=4).generate(
        [PROMPT] * 8, max_new_tokens=16, temperature=1.0, seed=0, ignore_eos=True)
    assert any(0 in row for row in sampled.token_ids)


# ------------------------------------------------------------------------------------------ stream, stats
def test_stream_yields_every_token_with_provenance(models, tokenizer):
    target, draft = models
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    stream = generator.stream([PROMPT, [8, 9]], max_new_tokens=20, temperature=1.0, seed=1, ignore_eos=True)
    events = list(stream)
    result = stream.result
    for row in (0, 1):
        mine = [e for e in events if e.row == row]
        assert [e.token_id for e in mine] == result.token_ids[row]
        assert [e.provenance for e in mine] == result.provenance[row]
        assert [e.finished for e in mine] == [False] * 19 + [True]
        assert mine[-1].finish_reason == "length"
    kinds = {e.provenance for e in events}
    assert kinds <= {"accepted", "resampled", "bonus", "target"} and {"accepted", "resampled"} <= kinds
    assert events[0].provenance == "target"  # the first token comes from the target's prefill
    # a resampled or bonus token closes every verification step, so each one follows its accepted run
    for row in result.provenance:
        for prev, cur in zip(row, row[1:]):
            assert not (prev == "accepted" and cur == "target")


def test_stream_text_deltas_add_up_to_the_text(tiny_pair, tokenizer):
    """Including a last token that ends in the middle of a multi-byte character (random models emit those)."""
    target, draft = tiny_pair
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3, tokenizer=tokenizer)
    seen = []
    result = generator.generate(["def quicksort(arr):", "The quick"], max_new_tokens=25, temperature=1.0, seed=3,
                                ignore_eos=True, on_token=seen.append)
    for row in (0, 1):
        assert "".join(e.text for e in seen if e.row == row) == result.texts[row]
    assert result.texts[0] == tokenizer.decode(result.token_ids[0], skip_special_tokens=True)


def test_statistics_are_consistent(models):
    target, draft = models
    result = SpeculativeGenerator(target, draft, num_speculative_tokens=4).generate(
        [PROMPT, [1, 2, 3]], max_new_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    s = result.stats
    assert s.proposed_tokens == sum(s.proposed_per_position) > 0
    assert s.accepted_tokens == sum(s.accepted_per_position)
    # drafts accepted past a row's max_new_tokens count as accepted but are not emitted
    assert s.accepted_tokens >= sum(p == "accepted" for r in result.provenance for p in r) > 0
    assert s.acceptance_rate == s.accepted_tokens / s.proposed_tokens
    assert s.new_tokens == 60
    assert s.mean_accepted_length == pytest.approx((s.new_tokens - 2) / s.verification_steps)
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:]))  # a run is a prefix
    assert s.draft_forward_calls >= s.target_forward_calls - 1
    assert s.wall_time_s >= s.prefill_time_s + s.draft_time_s + s.verify_time_s - 1e-6
    assert s.tokens_per_second == pytest.approx(s.new_tokens / s.wall_time_s)
    d = s.to_dict()
    for key in ("proposed_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
                "accepted_per_position", "target_forward_calls", "draft_forward_calls", "draft_time_s",
                "verify_time_s", "other_time_s", "wall_time_s", "tokens_per_second"):
        assert key in d


def test_plain_loop_has_the_same_result_type(models):
    target, _ = models
    result = AutoregressiveGenerator(target).generate([PROMPT], max_new_tokens=10, temperature=0.0, ignore_eos=True)
    assert result.token_ids[0] == hf_greedy(target, PROMPT, 10)
    assert result.stats.proposed_tokens == 0 and result.stats.mean_accepted_length == 1.0
    assert result.stats.target_forward_calls == 10 and result.stats.draft_forward_calls == 0


# ------------------------------------------------------------------------------------------------ seeds
def test_seed_is_reproducible_and_seeded_once_per_call(models, monkeypatch):
    target, draft = models
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    kwargs = dict(max_new_tokens=20, temperature=1.0, ignore_eos=True)
    a = generator.generate([PROMPT] * 3, seed=7, **kwargs).token_ids
    assert generator.generate([PROMPT] * 3, seed=7, **kwargs).token_ids == a
    assert generator.generate([PROMPT] * 3, seed=8, **kwargs).token_ids != a
    assert len({tuple(r) for r in a}) > 1  # rows of one call are independent draws
    seeds = []

    def counting_stream(seed, index=0):
        seeds.append((seed, index))
        return real_stream(seed, index)

    real_stream = sampling.row_stream
    monkeypatch.setattr(sampling, "row_stream", counting_stream)
    result = generator.generate([PROMPT], seed=9, **kwargs)
    assert result.stats.target_forward_calls > 3
    assert seeds == [(9, 0)]  # seeded once for the call, never reseeded per step


def test_plain_and_speculative_sampling_are_distinct_draws_of_the_same_law(models):
    """Without a seed each call draws fresh randomness."""
    target, draft = models
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    runs = {tuple(generator.generate(PROMPT, max_new_tokens=12, temperature=1.0, ignore_eos=True).token_ids[0])
            for _ in range(4)}
    assert len(runs) > 1


def test_cancel_ends_one_row_and_spares_the_others(models):
    target, draft = models
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    stream = generator.stream([PROMPT, [4, 5, 6]], max_new_tokens=30, temperature=0.0, ignore_eos=True)
    for event in stream:
        if event.row == 0:
            stream.cancel(0)
    result = stream.result
    assert result.finish_reasons == ["cancelled", "length"]
    assert len(result.token_ids[0]) < 30
    assert result.token_ids[1] == hf_greedy(target, [4, 5, 6], 30)


# ------------------------------------------------------------------------------------------- vocabularies
def test_padded_embedding_rows_are_restricted_to_the_tokenizer(tokenizer, tiny_pair):
    target, draft = tiny_pair
    padded = copy.deepcopy(draft)
    padded.resize_token_embeddings(len(tokenizer) + 64)  # like Qwen's 151936 vs 152064 rows
    with torch.no_grad():
        padded.lm_head.weight[len(tokenizer):] = 50.0  # garbage rows that would win every argmax if used
    generator = SpeculativeGenerator(target, padded, num_speculative_tokens=3, tokenizer=tokenizer)
    prompt = tokenizer("def quicksort(arr):")["input_ids"]
    result = generator.generate([prompt], max_new_tokens=15, temperature=0.0, ignore_eos=True)
    assert result.token_ids[0] == hf_greedy(target, prompt, 15)
    sampled = generator.generate([prompt] * 4, max_new_tokens=15, temperature=1.0, seed=0, ignore_eos=True)
    assert max(max(r) for r in sampled.token_ids) < len(tokenizer)


def test_different_vocabularies_are_bridged_and_different_sizes_without_tokenizers_refused(tokenizer, tiny_pair):
    from conftest import build_tokenizer
    from specdecode.drafters import CrossVocabDrafter

    target, draft = tiny_pair
    other = build_tokenizer(vocab_size=300)  # a draft of another tokenizer drafts through its text (cross_vocab.py)
    assert isinstance(SpeculativeGenerator(load_wrap(target, tokenizer), load_wrap(draft, other)).drafter,
                      CrossVocabDrafter)
    bigger = tiny_qwen(len(tokenizer) + 10, seed=1)
    with pytest.raises(VocabularyMismatchError, match="vocab_size"):
        SpeculativeGenerator(target, bigger)
    # with the shared size given explicitly, bare models of different sizes work
    SpeculativeGenerator(target, bigger, vocab_size=len(tokenizer))


def load_wrap(model, tokenizer):
    from specdecode.models import LoadedModel

    return LoadedModel(model, tokenizer, "m", "")


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("prompts, message", [
    ([[]], "empty"), ([], "no prompts"), ([[1, 2], []], "prompt 1 is empty"), ([[1, 10_000]], "outside the vocabulary"),
])
def test_bad_prompts_are_clear_errors(models, prompts, message):
    target, draft = models
    with pytest.raises(ValueError, match=message):
        SpeculativeGenerator(target, draft).generate(prompts)


def test_empty_text_prompt_is_a_clear_error(tiny_pair, tokenizer):
    target, draft = tiny_pair
    with pytest.raises(ValueError, match="empty"):
        SpeculativeGenerator(target, draft, tokenizer=tokenizer).generate("")
    with pytest.raises(ValueError, match="tokenizer"):
        SpeculativeGenerator(target, draft).generate("text without a tokenizer")


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens"), ({"num_speculative_tokens": -1}, "0..32"), ({"num_speculative_tokens": "fast"}, "auto"),
    ({"max_new_tokens": 600}, "context"), ({"stop": [""]}, "stop"),
])
def test_bad_generation_arguments_are_clear_errors(models, kwargs, message):
    target, draft = models
    with pytest.raises(ValueError, match=message):
        SpeculativeGenerator(target, draft).generate(PROMPT, **kwargs)


def test_bad_constructor_arguments_are_clear_errors(models):
    target, draft = models
    with pytest.raises(ValueError, match="leviathan, chen"):
        SpeculativeGenerator(target, draft, method="typical")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeGenerator(target, draft, num_speculative_tokens=-2)
    with pytest.raises(TypeError, match="ModelBackend"):
        SpeculativeGenerator(object(), draft)


# ---------------------------------------------------------------------------------------------- loading
def test_load_model_from_a_directory_and_generate_text(tiny_model_dirs):
    target, draft = load_model(tiny_model_dirs["target"]), load_model(tiny_model_dirs["draft"])
    assert target.tokenizer is not None
    result = SpeculativeGenerator(target, draft, num_speculative_tokens=3).generate(
        ["def quicksort(arr):", "import numpy"], max_new_tokens=12, temperature=0.0, stop=["\n\n\n\n\n"])
    assert len(result.texts) == 2 and all(isinstance(t, str) for t in result.texts)
    plain = AutoregressiveGenerator(target).generate(["def quicksort(arr):", "import numpy"], max_new_tokens=12,
                                                     temperature=0.0)
    assert result.token_ids == plain.token_ids


def test_stop_strings_cut_the_text(tiny_model_dirs):
    target, draft = load_model(tiny_model_dirs["target"]), load_model(tiny_model_dirs["draft"])
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    full = generator.generate("def quicksort(arr):", max_new_tokens=30, temperature=0.0, ignore_eos=True).texts[0]
    stop = full[5:7]
    cut = generator.generate("def quicksort(arr):", max_new_tokens=30, temperature=0.0, ignore_eos=True, stop=stop)
    assert cut.texts[0] == full[: full.index(stop)]
    assert cut.finish_reasons == ["stop"]


def test_load_model_errors_are_clear(tmp_path):
    from specdecode.models import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="not found"):
        load_model("no-such-model-anywhere")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="local Hugging Face cache"):
        load_model("some-org/some-model-not-cached")
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), dtype="float8")
    with pytest.raises(RuntimeError, match="CUDA"):
        load_model(str(tmp_path), device="cuda")


# ------------------------------------------------------------------------------------------ other drafters
def test_prompt_lookup_drafter_greedy_equals_target_and_copies_repeats(models):
    from specdecode import PromptLookupDrafter

    target, _ = models
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]
    reference = hf_greedy(target, prompt, 20)
    drafter = PromptLookupDrafter(max_ngram=3)
    result = SpeculativeGenerator(target, drafter, num_speculative_tokens=4).generate(
        [prompt, [1, 2]], max_new_tokens=20, temperature=0.0, ignore_eos=True)
    assert result.token_ids[0] == reference
    assert result.token_ids[1] == hf_greedy(target, [1, 2], 20)
    assert result.stats.draft_forward_calls == 0
    assert drafter._lookup([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]  # what followed the last "5 6"
    assert drafter._lookup([1, 2, 3], 2) == []  # nothing to copy: no drafts, the row takes a plain step


def test_quantized_and_prepacked_models_work_as_target_and_draft(models):
    """int8 drafts (lossless: only q changes) and prepacked targets (same function up to fp32 rounding)."""
    from specdecode.models.optimize import prepack_linear_layers, quantize_dynamic_int8

    target, draft = models
    int8_draft = quantize_dynamic_int8(draft)
    reference = hf_greedy(target, PROMPT, 16)
    result = SpeculativeGenerator(target, int8_draft, num_speculative_tokens=3).generate(
        [PROMPT, [1]], max_new_tokens=16, temperature=0.0, ignore_eos=True)
    assert result.token_ids[0] == reference
    packed = prepack_linear_layers(copy.deepcopy(target))
    result = SpeculativeGenerator(packed, int8_draft, num_speculative_tokens=3).generate(
        PROMPT, max_new_tokens=16, temperature=0.0, ignore_eos=True)
    assert result.token_ids[0] == reference


def test_per_row_statistics_and_a_row_that_ends_on_its_first_token(models):
    target, draft = models
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    generator.generate([PROMPT], max_new_tokens=5, temperature=0.0, ignore_eos=True)
    # a bigger batch next, whose first row finishes at the prefill (drafter state of the last call must not leak)
    result = generator.generate([PROMPT, [1, 2], [3]], max_new_tokens=[1, 9, 9], temperature=0.0, ignore_eos=True)
    assert [len(t) for t in result.token_ids] == [1, 9, 9]
    rows = result.row_stats
    assert rows[0].verification_steps == 0 and rows[0].new_tokens == 1
    assert sum(r.proposed_tokens for r in rows) == result.stats.proposed_tokens
    assert sum(r.accepted_tokens for r in rows) == result.stats.accepted_tokens
    assert sum(r.verification_steps for r in rows) == result.stats.verification_steps
    assert rows[1].mean_accepted_length == pytest.approx(8 / rows[1].verification_steps)
    assert generator.has_draft and generator.context_length == 512 and generator.vocab_size == 128


def test_different_seeds_never_share_a_row_stream(models):
    """Row i of seed S and row i + 1 of seed S - 1 were one stream under the old S + i rule: a batch run "with seeds
    1..10" then repeated most of its samples. Streams are now SeedSequence-mixed from (seed, row)."""
    target, draft = models
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    kwargs = dict(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    one = generator.generate([PROMPT] * 6, seed=1, **kwargs).token_ids
    two = generator.generate([PROMPT] * 6, seed=2, **kwargs).token_ids
    assert sum(a == b for a, b in zip(one[1:], two[:-1])) == 0  # the old rule made all 5 equal
    assert len({tuple(r) for r in one + two}) == 12
    alone = generator.generate([PROMPT], seed=2, **kwargs).token_ids[0]
    assert alone == two[0]  # a seed reproduces itself alone and as row 0 of a batch
    assert {stream_seed(s, i) for s in range(50) for i in range(50)}.__len__() == 2500
    # ... and so does the state of the generator that draws, and its first numbers
    streams = [RowGenerators([s], seed_indices=[i]).streams[0] for s in range(50) for i in range(50)]
    assert len({(g.bit_generator.state["state"]["state"], g.bit_generator.state["state"]["inc"])
                for g in streams}) == 2500
    assert len({tuple(g.random(2)) for g in streams}) == 2500


@functools.cache
def colliding_seeds() -> tuple[int, int]:
    """The first two seeds whose 63-bit stream seeds share their low 32 bits, the part torch's CPU generator
    (MT19937) keeps: found by a birthday search over 0, 1, 2, ... (~54k seeds, 0.3 s)."""
    seen = {}
    for seed in itertools.count():
        low = stream_seed(seed) & 0xFFFF_FFFF
        if low in seen:
            return seen[low], seed
        seen[low] = seed


def test_seeds_whose_stream_seeds_share_the_low_word_draw_different_numbers():
    a, b = colliding_seeds()
    assert stream_seed(a) != stream_seed(b)  # distinct 63-bit values: the old test of streams passed on these
    uniforms = RowGenerators([a, b]).uniforms([16, 16])
    assert not torch.equal(uniforms[0], uniforms[1])
    noise = RowGenerators([a, b], coupled=[True, True]).noise(2, 64)
    assert not torch.equal(noise[0], noise[1])


@pytest.mark.parametrize("k", [0, 3, "auto"])
def test_seeds_whose_stream_seeds_share_the_low_word_sample_different_text(models, k):
    """Plain decoding and the rejection sampler draw uniforms, "auto" Gumbel noise: every path gets its own stream.
    With the low word alone (torch's CPU generator) both seeds gave the same tokens at fixed K and K = 0."""
    target, draft = models
    a, b = colliding_seeds()
    generator = AutoregressiveGenerator(target) if k == 0 else \
        SpeculativeGenerator(target, draft, num_speculative_tokens=k)
    kwargs = dict(max_new_tokens=16, temperature=1.0, ignore_eos=True)
    one = generator.generate([PROMPT] * 2, seed=[a, a + 1], **kwargs).token_ids
    two = generator.generate([PROMPT] * 2, seed=[b, a + 1], **kwargs).token_ids
    assert one[0] != two[0]
    assert one[1] == two[1]  # the same seed still reproduces itself
