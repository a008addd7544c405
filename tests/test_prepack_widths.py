"""A prepacked linear runs at a bounded set of row counts (issue 41): oneDNN keeps a kernel per (weight shape, row
count), ~0.6 MiB each, so a server whose forwards took every width grew by hundreds of MiB. Forwards of up to
EXACT_ROWS rows run as they are; wider ones are padded with zero rows to one of 8 widths per power of two, and
each real row's output is the one it gets alone, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from specdecode.models import optimize
from specdecode.models.optimize import EXACT_ROWS, PrepackedLinear, padded_rows

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs torch with oneDNN")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_widths_are_bounded_and_cost_at_most_an_eighth():
    widths = {padded_rows(m) for m in range(1, 257)}
    assert len(widths) <= 48 and set(range(1, EXACT_ROWS + 1)) <= widths
    for m in range(1, 5000):
        assert m <= padded_rows(m) <= m * 9 / 8, m
        assert padded_rows(padded_rows(m)) == padded_rows(m)  # a bucket is its own width


def test_the_kernel_sees_only_bucket_widths(monkeypatch):
    seen = set()
    kernel = optimize._pointwise

    def recording(x, weight, bias):
        seen.add(x.shape[0])
        return kernel(x, weight, bias)

    monkeypatch.setattr(optimize, "_pointwise", recording)
    layer = PrepackedLinear(nn.Linear(32, 24))
    for m in range(1, 300):
        assert layer(torch.randn(m, 32)).shape == (m, 24)
    assert seen == {padded_rows(m) for m in range(1, 300)} and len(seen) <= 56


@pytest.mark.parametrize("shape", [(64, 320), (96, 352)])
def test_each_row_is_what_it_is_alone_bit_for_bit(shape):
    torch.manual_seed(0)
    dense = nn.Linear(*shape)
    layer = PrepackedLinear(dense)
    x = torch.randn(3, 90, shape[0])  # a batch of rows x tokens, as a model's forward has
    for tokens in (1, 5, 6, 17, 33, 90):
        part = x[:, :tokens]
        y = layer(part)
        assert y.shape == (3, tokens, shape[1])
        exact = optimize._pointwise(part.reshape(-1, shape[0]), layer.packed_weight, layer.bias)
        assert torch.equal(y.reshape(-1, shape[1]), exact), tokens  # padding changed no real row
        torch.testing.assert_close(y, dense(part), rtol=1e-4, atol=1e-4)


def test_memory_stays_bounded_over_every_width():
    """Every width from 1 to 600 through one layer (a shape no other test uses): ~0.6 MiB a width before the
    buckets (about 350 MiB here), a few MiB with them."""
    layer = PrepackedLinear(nn.Linear(40, 56))
    for m in range(1, 300):  # the buckets below 300 are built: what is left to grow is what a width adds
        layer(torch.randn(m, 40))
    before = _rss_mib()
    for m in range(300, 600):
        layer(torch.randn(m, 40))
    assert _rss_mib() - before < 40, "oneDNN kernels kept per width"
