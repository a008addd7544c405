"""StaticBackend(compile=True): the small steps run through torch.compile (Inductor's C++ backend on the CPU, the
same graphs Inductor fuses on a GPU), their widths padded to buckets. The compiled step must give the eager step's
logits, and speculative decoding through it the target's own greedy tokens. Each compiled graph costs tens of
seconds on two busy cores, so one module-wide backend compiles three (the 4-, 2- and 1-token steps): prompts
longer than 16 tokens prefill eagerly, as on a GPU. On the device named by SPECDECODE_TEST_DEVICE (the device
check runs this file with cuda) the mode is "reduce-overhead": Inductor's kernels replayed as CUDA graphs."""

import copy
import os

import pytest
import torch

from conftest import perturbed_copy, tiny_qwen
from specdecode import AutoregressiveGenerator, SpeculativeGenerator
from specdecode.backends.static import StaticBackend

pytestmark = pytest.mark.slow
DEVICE = torch.device(os.environ.get("SPECDECODE_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("SPECDECODE_TEST_DEVICE=cuda, and no CUDA GPU is here", allow_module_level=True)

VOCAB = 96
PROMPT = [5, 17, 3, 44, 9, 12, 80, 61, 2, 7, 31, 0, 90, 11, 23, 54, 8, 19, 27]  # > 16 tokens: an eager prefill


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen(VOCAB, seed=0)
    return copy.deepcopy(target).to(DEVICE), perturbed_copy(target, 0.3, seed=1).to(DEVICE)


@pytest.fixture(scope="module")
def compiled(models):
    return StaticBackend(models[0], max_batch=1, max_len=64, compile=True)


def test_compiled_logits_equal_eager_through_padded_widths_on_the_device(models, compiled):
    eager = StaticBackend(models[0], max_batch=1, max_len=64, cuda_graphs=False)
    assert compiled.compile_mode == {"cpu": "default", "cuda": "reduce-overhead"}[DEVICE.type]
    assert compiled.captured_graphs == 0  # on CUDA, compile's own graphs replace this backend's
    gen = torch.Generator().manual_seed(0)
    for backend in (eager, compiled):
        backend.reset(1)
        backend.forward(torch.tensor([PROMPT], device=DEVICE))
    for n in (4, 1, 3, 1, 4, 2):  # 3 tokens padded to the 4-token bucket, 2 tokens to its own
        ids = torch.randint(0, VOCAB, (1, n), generator=gen).to(DEVICE)
        expected, got = eager.forward(ids), compiled.forward(ids)
        assert got.shape == expected.shape == (1, n, VOCAB)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert compiled.lengths == eager.lengths
        trimmed = [compiled.lengths[0] - n // 2]  # rejected drafts: the next step overwrites their slots
        eager.trim(trimmed)
        compiled.trim(trimmed)
    # 4 tokens (seen 3 times), 1 (twice) and 2 (once) at one span: each cold on its first sight (its compilation),
    # on CUDA its second too (compile's CUDA graph is recorded then)
    assert compiled.cold_forwards == {"cpu": 3, "cuda": 5}[DEVICE.type] and eager.cold_forwards == 0


def test_greedy_speculative_through_the_compiled_step_is_plain_decoding_on_the_device(models, compiled):
    plain = AutoregressiveGenerator(StaticBackend(models[0], max_batch=1, max_len=64)).generate(
        [PROMPT], max_new_tokens=20, temperature=0.0, ignore_eos=True)
    draft = StaticBackend(models[1], max_batch=1, max_len=64)
    result = SpeculativeGenerator(compiled, draft, num_speculative_tokens=3).generate(
        [PROMPT], max_new_tokens=20, temperature=0.0, ignore_eos=True)
    assert result.token_ids == plain.token_ids
    assert 0 < result.stats.accepted_tokens < result.stats.proposed_tokens  # both branches of verification ran
    through = AutoregressiveGenerator(compiled).generate([PROMPT], max_new_tokens=20, temperature=0.0,
                                                         ignore_eos=True)
    assert through.token_ids == plain.token_ids


def test_bad_compile_modes_are_refused(models):
    with pytest.raises(ValueError, match="compile must be True, False or a torch.compile mode"):
        StaticBackend(models[0], compile="fast")
