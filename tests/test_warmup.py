"""Warm-up at load (backends/warmup.py): every step shape a generation can need runs before the first request, so
the policy never times a cold step. CUDA graphs need a GPU, so the stand-in here is a StaticBackend on the CPU that
buckets its widths and counts the first two sights of each shape as cold, exactly as its CUDA-graph path does
(first sight eager, second captured); the warm-up logic, the shapes and the counter are the real ones."""

import pytest
import torch

from conftest import perturbed_copy, tiny_qwen
from specdecode import AutoregressiveGenerator, SpeculativeGenerator
from specdecode.backends.base import cold_forwards
from specdecode.backends.static import BUCKETS, StaticBackend
from specdecode.backends.warmup import step_shapes, warm_up
from specdecode.drafters.model import ModelDrafter

VOCAB = 96
PROMPTS = [[5, 17, 3, 44, 9, 12, 80], [61, 2, 7]]


def graph_like(model, max_batch=2, max_len=100):
    """StaticBackend on the CPU with the graph path's buckets and cold sights (its capture is CUDA-only)."""
    backend = StaticBackend(model, max_batch=max_batch, max_len=max_len)
    backend._buckets, backend._cold_sights = BUCKETS, 2
    return backend


@pytest.fixture(scope="module")
def pair():
    target = tiny_qwen(VOCAB, seed=0)
    return target, perturbed_copy(target, 0.3, seed=1)


def test_the_shapes_are_every_bucket_at_every_span_and_batch(pair):
    backend = graph_like(pair[0], max_len=100)  # 116 slots with the spare ones: spans 64 and 116
    assert backend.spans() == [64, 116]
    shapes = step_shapes(backend, batches=(2, 1))
    # every bucket at every span; at the last one, near the capacity, every width that no bucket fits
    widths = {64: set(BUCKETS), 116: set(range(1, 17))}
    expected = {(b, w, span, last, False) for b in (1, 2) for span in (64, 116) for w in widths[span]
                for last in (False, True)}
    assert set(shapes) == expected and len(shapes) == len(expected)
    assert [s[:3:2] for s in shapes] == sorted(s[:3:2] for s in shapes)  # batch 1 and short spans first
    assert backend.step_shape(1, 3, 10) == (1, 4, 64, False, False)  # K = 3 verifies 4 tokens: no padding
    assert backend.step_shape(1, 5, 10) == (1, 8, 64, False, False)
    assert backend.step_shape(1, 16, 100)[1] == 16 and backend.step_shape(1, 6, 110)[1] == 6  # no room: exact
    assert backend.step_shape(1, 40, 10)[1] == 40  # prefill: never padded


@pytest.mark.parametrize("k", [3, "auto"])
def test_after_warm_up_no_forward_of_a_generation_is_cold(pair, k):
    target, draft = graph_like(pair[0]), graph_like(pair[1])
    for backend in (target, draft):
        report = backend.warm_up(batches=(1, 2), log=None)
        assert not report.skipped and report.warmed == step_shapes(backend, (1, 2)) == backend.warmed
        assert backend.cold_forwards == 2 * len(report.warmed) and cold_forwards(backend) == report.cold_forwards
        assert all(backend.is_warm(s) for s in report.warmed) and backend.lengths == [0]
    before = target.cold_forwards, draft.cold_forwards
    gen = SpeculativeGenerator(target, ModelDrafter(draft), num_speculative_tokens=k)
    for prompts in (PROMPTS[:1], PROMPTS):
        result = gen.generate(prompts, max_new_tokens=30, temperature=0.0, ignore_eos=True)
        plain = AutoregressiveGenerator(StaticBackend(pair[0], max_batch=2, max_len=100)).generate(
            prompts, max_new_tokens=30, temperature=0.0, ignore_eos=True)
        assert result.token_ids == plain.token_ids  # the padded widths change no token
    assert (target.cold_forwards, draft.cold_forwards) == before
    if k == 3:
        assert result.stats.accepted_tokens > 0


def test_without_warm_up_the_same_generation_has_cold_forwards(pair):
    """The control: the counter does see the generation's cold shapes when nothing warmed them."""
    target, draft = graph_like(pair[0]), graph_like(pair[1])
    gen = SpeculativeGenerator(target, ModelDrafter(draft), num_speculative_tokens=3)
    gen.generate(PROMPTS, max_new_tokens=30, temperature=0.0, ignore_eos=True)
    assert target.cold_forwards > 0 and draft.cold_forwards > 0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class StandIn:
    """A backend whose every warm step takes one second of a fake clock and whose shapes warm on a second sight."""

    cold_forwards = 0

    def __init__(self, clock):
        self.clock, self.sights = clock, {}

    def is_warm(self, shape):
        return self.sights.get(shape, 0) >= 2

    def warm_shape(self, shape):
        self.clock.now += 1.0
        self.sights[shape] = self.sights.get(shape, 0) + 1
        self.cold_forwards += 1


def test_the_warm_up_starts_no_shape_past_its_time_bound_and_says_so():
    clock, lines = Clock(), []
    backend = StandIn(clock)
    shapes = [(1, w, 64, False, False) for w in BUCKETS]
    report = warm_up(backend, shapes, seconds=3.0, log=lines.append, clock=clock)
    # 2 s a shape: shapes start at 0, 2 and 4 s; the one starting at 4 s is past the bound, so are the rest
    assert report.warmed == shapes[:2] and report.skipped == shapes[2:] and report.seconds == 4.0
    assert backend.warmed == shapes[:2] and backend.cold_forwards == 4
    assert lines == ["warm-up: 2 step shapes in 4.0 s, 3 left cold (the 3 s bound)"]


def test_a_shape_that_never_warms_is_an_error():
    class Never(StandIn):
        def is_warm(self, shape):
            return False

    with pytest.raises(RuntimeError, match="still cold after 4 warm-up steps"):
        warm_up(Never(Clock()), [(1, 1, 64, False, False)], log=None)


def test_warm_up_needs_an_empty_cache(pair):
    backend = graph_like(pair[0])
    backend.forward(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="needs an empty cache.*reset"):
        backend.warm_up(log=None)
