"""StaticBackend (preallocated KV cache, CUDA graphs on a GPU) computes what HFBackend computes: the same logits
through any sequence of forwards, trims, rows leaving and rows joining, and token-for-token the target's greedy
output when it runs both sides of speculative decoding. CUDA graph tests run only where a GPU is present."""

import copy

import pytest
import torch
from transformers import (GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from conftest import perturbed_copy, tiny_qwen
from specdecode import SpeculativeGenerator
from specdecode.backends import pad
from specdecode.backends.hf import HFBackend
from specdecode.backends.static import SPARE_SLOTS, StaticBackend

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
ARCHITECTURES = {
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
    "qwen2-eager": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, attn_implementation="eager")),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=8)),
    "gemma": lambda: GemmaForCausalLM(GemmaConfig(**{**SMALL, "num_key_value_heads": 1}, head_dim=8)),
}
PROMPTS = [[5, 17, 3, 44, 9, 12, 80], [61], [2, 2, 7, 31], [0, 90, 11, 23, 54, 8, 19, 27, 3, 5, 6]]
NEW_TOKENS = [24, 9, 24, 15]  # rows 1 and 3 finish early: the batch shrinks (select_rows) mid-generation


def build(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch]().eval()
    with torch.no_grad():  # peaked distributions, like a trained model's
        model.get_output_embeddings().weight.mul_(4.0)
    return model


class Pair:
    """The same calls on HFBackend and StaticBackend; every result compared on real (valid) positions."""

    def __init__(self, hf, static):
        self.hf, self.static = hf, static
        self.gen = torch.Generator().manual_seed(0)

    def reset(self, batch):
        self.hf.reset(batch)
        self.static.reset(batch)

    def forward(self, ids, valid=None, last_only=False, output_hidden=False):
        expected = self.hf.forward(ids, valid, last_only=last_only, output_hidden=output_hidden)
        got = self.static.forward(ids, valid, last_only=last_only, output_hidden=output_hidden)
        if not output_hidden:
            expected, got = (expected, None), (got, None)
        real = torch.ones(got[0].shape[:2], dtype=torch.bool)
        if valid is not None:  # padding's outputs are undefined, a row of padding only included
            real = valid.any(dim=1, keepdim=True) if last_only else valid
        torch.testing.assert_close(got[0][real], expected[0][real], atol=1e-5, rtol=1e-5)
        assert got[0].shape == expected[0].shape and got[0].dtype == torch.float32
        if output_hidden:
            real = valid if valid is not None else torch.ones(ids.shape, dtype=torch.bool)
            torch.testing.assert_close(got[1][real], expected[1][real], atol=1e-5, rtol=1e-5)
        assert self.static.lengths == self.hf.lengths
        return got[0]

    def random(self, rows, n, **kwargs):
        return self.forward(torch.randint(0, VOCAB, (rows, n), generator=self.gen), **kwargs)

    def trim(self, lengths):
        self.hf.trim(lengths)
        self.static.trim(lengths)

    def select_rows(self, rows):
        self.hf.select_rows(rows)
        self.static.select_rows(rows)
        assert self.static.lengths == self.hf.lengths

    def fork(self, batch):
        return Pair(self.hf.fork(batch), self.static.fork(batch))

    def merge(self, other):
        self.hf.merge(other.hf)
        self.static.merge(other.static)
        assert self.static.lengths == self.hf.lengths


def script(pair: Pair):
    """Prefill of ragged prompts, verifications, trims of different lengths per row (holes for HFBackend), ragged
    catch-up tokens, rows leaving, rows joining (a fork prefilled in chunks, then merged); long enough to cross
    the attended-slot sizes 64 and 128."""
    ids, valid = pad([PROMPTS[0] * 5, PROMPTS[1], PROMPTS[2]], "cpu")
    pair.reset(3)
    pair.forward(ids, valid)  # left padding, every position compared
    pair.random(3, 5)
    lengths = pair.static.lengths
    pair.trim([lengths[0] - 3, lengths[1], lengths[2] - 1])  # row 1 keeps all while the others reject
    ids, valid = pad([[1, 2], [3], [4, 5]], "cpu", side="right")
    pair.forward(ids, valid, last_only=True)  # the draft's ragged catch-up
    for step in range(20):
        pair.random(3, 4, output_hidden=step == 0)
        lengths = pair.static.lengths
        pair.trim([n - (step + b) % 4 for b, n in enumerate(lengths)])
        pair.random(3, 1, last_only=True)
    pair.select_rows([0, 2])
    joining = pair.fork(2)
    ids, valid = pad([PROMPTS[3], PROMPTS[1]], "cpu")
    for col in range(0, ids.shape[1], 4):  # chunked prefill: the second row's first chunks are all padding
        joining.forward(ids[:, col:col + 4], valid[:, col:col + 4], last_only=True)
        pair.random(2, 3)  # the running rows keep decoding meanwhile
    joining.select_rows([1, 0])
    pair.merge(joining)
    for step in range(12):
        pair.random(4, 3)
        pair.trim([n - (step + b) % 3 for b, n in enumerate(pair.static.lengths)])
    pair.select_rows([0])
    pair.random(1, 6, output_hidden=True)
    assert max(pair.static.lengths) > 128


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_logits_equal_hf_backend_through_forwards_trims_and_row_selection(arch):
    model = build(arch)
    script(Pair(HFBackend(model), StaticBackend(model, max_batch=4, max_len=200)))


def hf_greedy(model, prompt, new_tokens):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def qwen_pair():
    target = tiny_qwen(VOCAB, seed=0)
    draft = perturbed_copy(target, 0.3, seed=1)
    return target, draft, [hf_greedy(target, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]


def tight_static(model, prompts, new_tokens, **kwargs):
    """A StaticBackend exactly as long as the longest prompt + new tokens: the spare slots must cover the drafts."""
    return StaticBackend(model, max_batch=len(prompts), max_len=max(len(p) + n for p, n in zip(prompts, new_tokens)),
                         **kwargs)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("rows", [1, 4])
def test_greedy_speculative_decoding_equals_target_generate(qwen_pair, k, rows):
    target, draft, references = qwen_pair
    prompts, limits = PROMPTS[:rows], NEW_TOKENS[:rows]
    generator = SpeculativeGenerator(tight_static(target, prompts, limits), tight_static(draft, prompts, limits),
                                     num_speculative_tokens=k)
    result = generator.generate(prompts, max_new_tokens=limits, temperature=0.0, ignore_eos=True)
    assert result.token_ids == references[:rows]
    assert 0 < result.stats.acceptance_rate < 1  # rejections and acceptances both happened


def test_rows_joining_a_running_batch_equal_their_solo_runs(qwen_pair):
    """Continuous batching: requests join between steps (fork, chunked prefill, merge) and leave when done."""
    target, draft, references = qwen_pair
    gen = SpeculativeGenerator(tight_static(target, PROMPTS, NEW_TOKENS), tight_static(draft, PROMPTS, NEW_TOKENS),
                               num_speculative_tokens=3)
    session = gen.session(prefill_tokens_per_step=4)
    arrivals = {0: [0, 1], 2: [2], 5: [3]}
    rows, tokens, step = {}, {}, 0
    while arrivals or not session.idle:
        for i in arrivals.pop(step, []):
            rows[session.add(gen.request(PROMPTS[i], NEW_TOKENS[i], temperature=0.0, ignore_eos=True))] = i
        for event in session.step():
            tokens.setdefault(rows[event.row], []).append(event.token_id)
        step += 1
    assert [tokens[i] for i in range(len(PROMPTS))] == references


def test_sampled_tokens_equal_hf_backend_with_the_same_seeds(qwen_pair):
    """Same logits (to ~1e-6) and same per-row uniforms: the same sampled tokens, through rows finishing early."""
    target, draft, _ = qwen_pair
    kwargs = dict(max_new_tokens=NEW_TOKENS, temperature=[0.8, 1.0, 0.0, 0.6], top_p=[1.0, 0.9, 1.0, 1.0],
                  seed=11, ignore_eos=True)
    expected = SpeculativeGenerator(target, draft, num_speculative_tokens=3).generate(PROMPTS, **kwargs)
    got = SpeculativeGenerator(tight_static(target, PROMPTS, NEW_TOKENS), tight_static(draft, PROMPTS, NEW_TOKENS),
                               num_speculative_tokens=3).generate(PROMPTS, **kwargs)
    assert got.token_ids == expected.token_ids


def test_limits_give_errors_that_name_the_limit_and_the_fix(qwen_pair):
    target, draft, _ = qwen_pair
    backend = StaticBackend(target, max_batch=2, max_len=32)
    assert backend.max_positions == 32
    with pytest.raises(ValueError, match=r"3 rows exceeds .*max_batch=2: pass a larger max_batch="):
        backend.reset(3)
    with pytest.raises(ValueError, match=r"max_batch=2"):
        SpeculativeGenerator(backend, StaticBackend(draft), num_speculative_tokens=2).generate(
            PROMPTS[:3], max_new_tokens=4)
    backend.reset(1)
    backend.forward(torch.zeros(1, 30, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"needs {33 + SPARE_SLOTS} cache slots .*max_len=32.*pass a larger max_len="):
        backend.forward(torch.zeros(1, 3 + SPARE_SLOTS, dtype=torch.long))
    assert backend.lengths == [30]  # a refused forward changes nothing
    with pytest.raises(ValueError, match="context of 32 tokens"):  # the loop checks before any work
        SpeculativeGenerator(backend, StaticBackend(draft), num_speculative_tokens=2).generate(
            [[1] * 20], max_new_tokens=13)
    with pytest.raises(ValueError, match="trim"):
        backend.trim([31])
    with pytest.raises(ValueError, match="max_len must be an integer"):
        StaticBackend(target, max_len=0)


def test_unsupported_models_are_refused_with_the_alternative():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64))
    with pytest.raises(ValueError, match="does not support 'gpt2' models.*HFBackend"):
        StaticBackend(gpt2)
    sliding = Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    with pytest.raises(ValueError, match="sliding-window.*HFBackend"):
        StaticBackend(sliding)
    dynamic = LlamaForCausalLM(LlamaConfig(**SMALL, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="'dynamic' RoPE scaling.*HFBackend"):
        StaticBackend(dynamic)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_cuda_graphs_on_cpu_is_refused(qwen_pair):
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        StaticBackend(qwen_pair[0], cuda_graphs=True)
    assert StaticBackend(qwen_pair[0]).captured_graphs == 0  # "auto": eager on CPU


# ---------------------------------------------------------------------------------------------- GPU only
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


class GraphPair(Pair):
    """The same calls on an eager StaticBackend (self.hf) and a CUDA-graph one (self.static), same model."""

    def __init__(self, eager, graphs, atol=1e-5):
        super().__init__(eager, graphs)
        self.atol = atol

    def fork(self, batch):
        return GraphPair(self.hf.fork(batch), self.static.fork(batch), self.atol)

    def forward(self, ids, valid=None, last_only=False, output_hidden=False):
        ids, valid = ids.cuda(), (valid.cuda() if valid is not None else None)
        expected = self.hf.forward(ids, valid, last_only=last_only, output_hidden=output_hidden)
        got = self.static.forward(ids, valid, last_only=last_only, output_hidden=output_hidden)
        # both are StaticBackends: even the padding positions are computed alike
        torch.testing.assert_close(got, expected, atol=self.atol, rtol=self.atol)
        assert self.static.lengths == self.hf.lengths
        return got[0] if output_hidden else got


@needs_cuda
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cuda_graphs_give_the_eager_logits(dtype, atol):
    model = build("qwen2").to("cuda", dtype)
    pair = GraphPair(StaticBackend(model, max_batch=4, max_len=200, cuda_graphs=False),
                     StaticBackend(model, max_batch=4, max_len=200, cuda_graphs=True), atol)
    script(pair)
    assert pair.static.captured_graphs > 0 and pair.hf.captured_graphs == 0


@needs_cuda
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_identity_on_the_gpu_with_cuda_graphs(qwen_pair, k):
    target, draft, _ = qwen_pair
    target, draft = copy.deepcopy(target).cuda(), copy.deepcopy(draft).cuda()
    static_target = tight_static(target, PROMPTS, NEW_TOKENS)
    generator = SpeculativeGenerator(static_target, tight_static(draft, PROMPTS, NEW_TOKENS), num_speculative_tokens=k)
    for _ in range(2):  # the second generation replays the graphs captured during the first
        result = generator.generate(PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        assert result.token_ids == [hf_greedy(target, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]
    assert static_target.captured_graphs > 0
