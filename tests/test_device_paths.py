"""The suite's device paths on the device named by SPECDECODE_TEST_DEVICE (default cpu; the device check runs this
file with cuda): the rejection sampler and token trees on that device's tensors give what they give on the CPU
with the same uniforms, and speculative decoding on the transformers backend keeps the target's greedy output there,
in float32, bfloat16 and float16. On the CPU these run in CI (cheap, tiny models), so the file cannot rot."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from conftest import perturbed_copy, tiny_qwen
from specdecode import AutoregressiveGenerator, SpeculativeGenerator
from specdecode.backends.hf import HFBackend
from specdecode.backends.static import StaticBackend
from specdecode.exact.rejection import verify, verify_greedy
from specdecode.exact.token_tree import verify_tree_greedy, verify_tree_sampled

DEVICE = torch.device(os.environ.get("SPECDECODE_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("SPECDECODE_TEST_DEVICE=cuda, and no CUDA GPU is here", allow_module_level=True)

V = 50
PROMPTS = [[5, 17, 3, 9, 22, 8], [40, 2, 11]]
NEW = 12


def _dists(gen, *shape):
    return torch.softmax(torch.randn(*shape, V, generator=gen, dtype=torch.float64) * 2, dim=-1).float()


@pytest.mark.parametrize("method", ["leviathan", "chen"])
def test_the_rejection_sampler_on_the_device_decides_as_on_the_cpu(method):
    gen = torch.Generator().manual_seed(0)
    batch, k = 64, 4
    q, p = _dists(gen, batch, k), _dists(gen, batch, k + 1)
    drafts = torch.multinomial(q.reshape(batch * k, V), 1, generator=gen).reshape(batch, k)
    u = torch.rand(batch, k + 1, generator=gen, dtype=torch.float64)
    on_cpu = verify(drafts, q, p, u, method, num_drafts=[k] * (batch // 2) + [2] * (batch // 2))
    on_dev = verify(drafts.to(DEVICE), q.to(DEVICE), p.to(DEVICE), u.to(DEVICE), method,
                    num_drafts=[k] * (batch // 2) + [2] * (batch // 2))
    assert all(t.device.type == DEVICE.type for t in on_dev)
    assert [t.tolist() for t in on_dev] == [t.tolist() for t in on_cpu]
    assert 0 < int(on_cpu[0].sum()) < batch * k  # some drafts kept, some rejected: both branches ran


def test_greedy_verification_on_the_device():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 5, V, generator=gen)
    drafts = torch.argmax(logits[:, :4], dim=-1)
    drafts[::2, 1] = (drafts[::2, 1] + 1) % V  # even rows: the second draft is wrong
    on_cpu = verify_greedy(drafts, logits)
    on_dev = verify_greedy(drafts.to(DEVICE), logits.to(DEVICE))
    assert [t.tolist() for t in on_dev] == [t.tolist() for t in on_cpu]
    assert on_cpu[0].tolist() == [1, 4] * 4


def test_token_trees_on_the_device_decide_as_on_the_cpu():
    gen = torch.Generator().manual_seed(2)
    tokens, parents = [3, 7, 3, 1, 9], [-1, -1, 0, 0, 2]
    probs = _dists(gen, len(tokens) + 1)
    probs[0, 3] = probs[0, 7] = 0.3  # the root's candidates are likely: paths go down the tree
    probs = probs / probs.sum(dim=-1, keepdim=True)
    for seed in range(20):
        u = torch.rand(len(tokens) + 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert verify_tree_sampled(tokens, parents, probs.to(DEVICE), u.to(DEVICE)) == \
            verify_tree_sampled(tokens, parents, probs, u)
    scores = torch.log(probs)
    assert verify_tree_greedy(tokens, parents, scores.to(DEVICE)) == verify_tree_greedy(tokens, parents, scores)


@pytest.fixture(scope="module")
def pair():
    target = tiny_qwen(V, seed=0, eos_token_id=0)
    return target, perturbed_copy(target, 0.3, seed=1)


def _on_device(model, dtype):
    return copy.deepcopy(model).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["transformers", "static"])
def test_greedy_speculative_output_is_the_targets_own_on_the_device(pair, dtype, backend):
    target, draft = _on_device(pair[0], dtype), _on_device(pair[1], dtype)

    def wrap(model):
        if backend == "transformers":
            return HFBackend(model)
        return StaticBackend(model, max_batch=len(PROMPTS), max_len=64)  # CUDA graphs on a GPU ("auto")

    plain = AutoregressiveGenerator(wrap(target)).generate(PROMPTS, max_new_tokens=NEW, temperature=0.0,
                                                           ignore_eos=True)
    generator = SpeculativeGenerator(wrap(target), wrap(draft), num_speculative_tokens=3)
    result = generator.generate(PROMPTS, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    assert result.token_ids == plain.token_ids
    assert result.stats.accepted_tokens > 0
    if backend == "static" and DEVICE.type == "cuda":
        assert generator.target.captured_graphs > 0


def test_sampled_speculative_decoding_runs_on_the_device(pair):
    """Sampling on the device: the same seed gives the same tokens twice, and drafts are kept."""
    target, draft = _on_device(pair[0], torch.float32), _on_device(pair[1], torch.float32)
    generator = SpeculativeGenerator(HFBackend(target), HFBackend(draft), num_speculative_tokens=3)
    runs = [generator.generate(PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=7, ignore_eos=True)
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert all(len(row) == NEW for row in runs[0].token_ids)
    assert runs[0].stats.accepted_tokens > 0
