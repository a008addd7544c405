"""Greedy speculative decoding is token-for-token the target's own greedy decoding, for several architectures,
K in {1, 4, 8}, and ragged batches (each row equals that prompt decoded alone by transformers)."""

import pytest
import torch
from transformers import (BloomConfig, BloomForCausalLM, Gemma2Config, Gemma2ForCausalLM, GemmaConfig,
                          GemmaForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

from conftest import perturbed_copy
from specdecode import AutoregressiveGenerator, SpeculativeGenerator

VOCAB = 96
ARCHITECTURES = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                                   tie_word_embeddings=False)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, max_position_embeddings=128,
                                                  tie_word_embeddings=False)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, max_position_embeddings=128,
                                                  tie_word_embeddings=False)),
    "bloom": lambda: BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                                  tie_word_embeddings=False)),
    "gemma": lambda: GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                                  head_dim=8, max_position_embeddings=128,
                                                  tie_word_embeddings=False)),
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                                                     sliding_window=6, tie_word_embeddings=False)),
    # sliding windows shorter than the sequences: holes in the cache must never shift the window
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=2, num_attention_heads=4,
                                                         num_key_value_heads=1, head_dim=8,
                                                         max_position_embeddings=128, sliding_window=6,
                                                         tie_word_embeddings=False)),
}
PROMPTS = [[5, 17, 3, 44, 9, 12, 80], [61], [2, 2, 7, 31], [0, 90, 11, 23, 54, 8, 19, 27, 3, 5, 6]]
NEW_TOKENS = 24


def build(arch: str, seed: int):
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch]().eval()
    with torch.no_grad():  # peaked distributions, like a trained model's
        model.get_output_embeddings().weight.mul_(4.0)
    return model


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch_pair(request):
    target = build(request.param, seed=0)
    return request.param, target, perturbed_copy(target, 0.3, seed=1)


def hf_greedy(model, prompt, new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def references(arch_pair):
    _, target, _ = arch_pair
    return [hf_greedy(target, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("k, method", [(1, "leviathan"), (4, "leviathan"), (8, "leviathan"), (4, "chen")])
def test_ragged_batch_equals_target_greedy(arch_pair, references, k, method):
    arch, target, draft = arch_pair
    result = SpeculativeGenerator(target, draft, num_speculative_tokens=k, method=method).generate(
        PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert result.token_ids == references, arch
    assert 0 < result.stats.acceptance_rate < 1  # rejections and acceptances both happened


@pytest.mark.parametrize("k", [1, 8])
def test_each_prompt_alone_equals_target_greedy(arch_pair, references, k):
    arch, target, draft = arch_pair
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=k)
    for prompt, reference in zip(PROMPTS, references):
        assert generator.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0.0,
                                  ignore_eos=True).token_ids == [reference], arch


def test_plain_loop_equals_target_greedy(arch_pair, references):
    _, target, _ = arch_pair
    result = AutoregressiveGenerator(target).generate(PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                      ignore_eos=True)
    assert result.token_ids == references
    assert all(kind == "target" for row in result.provenance for kind in row)


def test_draft_of_another_architecture(references, arch_pair):
    """Any causal LM over the same vocabulary can draft: here a tiny Llama drafts for every architecture."""
    _, target, _ = arch_pair
    draft = build("llama", seed=5)
    result = SpeculativeGenerator(target, draft, num_speculative_tokens=3).generate(
        PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert result.token_ids == references


@pytest.mark.parametrize("chunk", [None, 3])
def test_rows_joining_a_running_batch_equal_target_greedy(arch_pair, references, chunk):
    """Continuous batching: prompts join between steps (prefilled in chunks beside the running rows, then merged
    into the shared cache with left-padded slots) and each still equals its prompt decoded alone."""
    _, target, draft = arch_pair
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    session = gen.session(prefill_tokens_per_step=chunk)
    rows = {session.add(gen.request(PROMPTS[0], NEW_TOKENS, temperature=0.0, ignore_eos=True)): 0}
    tokens: dict[int, list[int]] = {}
    joins = {2: 1, 4: 2, 5: 3}  # step number -> prompt that joins then
    step = 0
    while not session.idle or joins:
        step += 1
        if step in joins:
            rows[session.add(gen.request(PROMPTS[joins.pop(step)], NEW_TOKENS, temperature=0.0, ignore_eos=True))] = 0
        for event in session.step():
            tokens.setdefault(event.row, []).append(event.token_id)
    assert [tokens[r] for r in sorted(rows)] == references
