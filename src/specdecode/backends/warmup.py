"""Warm-up at load: every step shape a generation can need, run before the first request, so that no step the
policy times is cold (base.cold_forwards: a CUDA graph's first eager sight and capture, a compilation).

A backend that warms up offers step_shape(batch, n, past, last_only, output_hidden) -> the shape a forward runs as
(its width padded to a bucket), spans() -> every number of attended slots, is_warm(shape) and warm_shape(shape)
(one step of that shape on scratch slots); StaticBackend does (static.py). The shapes: for each batch size (1 and
the server's batch buckets), each attended span, each bucketed width (the target's K+1-token verification, the
draft's 1-token steps and catch-up) with last_only False (the target) and True (the draft); short spans and small
batches first, so that a time bound leaves the rarest shapes cold, not the common ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

DEFAULT_SECONDS = 60.0
MAX_SIGHTS = 4  # a shape still cold after this many steps never warms: a bug, not a slow machine


@dataclass
class WarmUpReport:
    warmed: list[tuple] = field(default_factory=list)
    skipped: list[tuple] = field(default_factory=list)  # left cold: the time bound was reached
    seconds: float = 0.0
    cold_forwards: int = 0  # the backend's counter after the warm-up: unchanged by any later warm step

    def summary(self, seconds_bound: float) -> str:
        cold = f", {len(self.skipped)} left cold (the {seconds_bound:.0f} s bound)" if self.skipped else ""
        return f"warm-up: {len(self.warmed)} step shapes in {self.seconds:.1f} s{cold}"


def step_shapes(backend, batches=(1,), widths=None, last_only=(False, True), output_hidden=False) -> list[tuple]:
    """Every distinct step shape of n in widths (default 1..graph_max_tokens: all map to a few buckets) new tokens
    per row at each batch size and span, in the order warm_up() should run them."""
    top = getattr(backend, "graph_max_tokens", 16)
    widths = widths or range(1, top + 1)
    shapes = []
    for batch in sorted(set(batches)):
        for span in backend.spans():
            for n in widths:
                # rows whose step attends this span: with room for n's bucket, and (at the last span, near the
                # capacity) without it, where the width stays n
                for past in (span - top, span - n):
                    for last in last_only:
                        shapes.append(backend.step_shape(batch, n, max(0, past), last, output_hidden))
    unique = list(dict.fromkeys(shapes))
    return sorted(unique, key=lambda shape: (shape[0], shape[2]))  # stable: small batches and spans first


def warm_up(backend, shapes, seconds: float = DEFAULT_SECONDS, log=print, clock=time.perf_counter) -> WarmUpReport:
    """Runs each shape until it is warm, in order, starting no shape after `seconds` (one shape can overrun it);
    records the shapes warmed on backend.warmed and logs one line."""
    report, start = WarmUpReport(), clock()
    for shape in shapes:
        if clock() - start > seconds:
            report.skipped.append(shape)
            continue
        for _ in range(MAX_SIGHTS):
            if backend.is_warm(shape):
                break
            backend.warm_shape(shape)
        if not backend.is_warm(shape):
            raise RuntimeError(f"step shape {shape} is still cold after {MAX_SIGHTS} warm-up steps")
        report.warmed.append(shape)
    report.seconds = clock() - start
    report.cold_forwards = getattr(backend, "cold_forwards", 0)
    backend.warmed = list(getattr(backend, "warmed", [])) + report.warmed
    if log:
        log(report.summary(seconds))
    return report
