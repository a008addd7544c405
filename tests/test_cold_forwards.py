"""A forward that captures a CUDA graph (or runs its shape's first sight eagerly) costs ~10x its replays: its timing
must not teach the policy what a step of that width costs, or `auto` never drafts on a GPU (the H200 device check:
two such probes read v(2) as 13 steps and settled on plain). Graphs need CUDA, so a backend that reports its first
two sights of each width as cold stands in for StaticBackend here."""

import pytest
import torch

from specdecode import SpeculativeGenerator
from specdecode.backends.base import cold_forwards
from specdecode.backends.hf import HFBackend
from specdecode.backends.static import StaticBackend
from specdecode.drafters.model import ModelDrafter
from specdecode.policy.choose import AdaptivePolicy


class GraphLike(HFBackend):
    """HFBackend whose first two forwards of each (batch, width) count as cold, as StaticBackend's graphs do."""

    def __init__(self, model, vocab_size=None):
        super().__init__(model, vocab_size)
        self.cold_forwards, self.seen = 0, {}

    def forward(self, input_ids, valid=None, last_only=False, output_hidden=False):
        key = tuple(input_ids.shape)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] <= 2:
            self.cold_forwards += 1
        return super().forward(input_ids, valid, last_only=last_only, output_hidden=output_hidden)

    def fork(self, batch_size):
        other = super().fork(batch_size)
        other.__class__, other.cold_forwards, other.seen = GraphLike, 0, {}
        return other


def _generator(tiny_pair, k):
    target, draft = tiny_pair
    vocab = target.config.vocab_size
    return SpeculativeGenerator(GraphLike(target, vocab), ModelDrafter(GraphLike(draft, vocab)),
                                num_speculative_tokens=k, vocab_size=vocab)


@pytest.mark.parametrize("k", [1, 3])
def test_cold_verifications_and_drafts_are_not_learned(tiny_pair, k):
    gen = _generator(tiny_pair, k)
    stream = gen.stream([[5, 6, 7, 8]], max_new_tokens=40, temperature=0.0, ignore_eos=True)
    session = stream.session
    for _ in stream:
        pass
    steps = session.stats.k_histogram
    widths = session.policy._verify[1]
    # the first two K-draft verifications were cold: only the rest are samples of v(K+1)
    assert steps[k] > 2 and widths[k + 1].count == steps[k] - 2
    # the draft's 1-token steps: cold on their first two sights of (1, 1), inside the first proposals
    assert session.policy._draft[1].count < steps[k]


def test_a_cold_timing_is_counted_at_the_estimate_not_learned():
    policy = AdaptivePolicy(max_k=4)
    rows = [policy.new_row()]
    for _ in range(3):
        policy.observe(rows, 0, [0], 1, None, 0.01)
    policy.observe(rows, 2, [2], 1, 0.002, None)  # a cold K=2 step: 58 ms on the H200, against 4.4 plain
    assert 3 not in policy._verify[1]
    policy.observe(rows, 2, [2], 1, 0.002, 0.012)
    assert policy._verify[1][3].count == 1 and policy._verify[1][3].value == pytest.approx(0.012)


def test_static_backend_on_cpu_has_no_cold_forwards(tiny_pair):
    target, _ = tiny_pair
    backend = StaticBackend(target, max_batch=1, max_len=64)
    backend.forward(torch.tensor([[1, 2, 3]]))
    for n in (1, 2, 1, 2, 1):
        backend.forward(torch.tensor([[4] * n]))
    assert cold_forwards(backend) == 0  # no graphs on the CPU: every forward is its shape's steady cost
    assert cold_forwards(HFBackend(target)) == 0
