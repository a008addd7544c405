"""Prometheus metrics of one app, in a registry of its own (so tests can build several apps in one process)."""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("specdecode_requests", "HTTP requests answered, by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.request_latency = Histogram("specdecode_request_latency_seconds", "Time from a request's arrival to "
                                         "the end of its response.", ["endpoint"], buckets=LATENCY_BUCKETS,
                                         registry=r)
        self.queue_wait = Histogram("specdecode_queue_wait_seconds", "Time a generation request waited in the "
                                    "queue before its batch started.", buckets=LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("specdecode_time_to_first_token_seconds", "Time from a generation "
                                             "request's arrival to its first token.", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.batch_size = Histogram("specdecode_batch_size", "Prompts per engine batch.", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.prompt_tokens = Counter("specdecode_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generated_tokens = Counter("specdecode_generated_tokens", "New tokens generated.", registry=r)
        self.proposed_tokens = Counter("specdecode_draft_proposed_tokens", "Draft tokens proposed.", registry=r)
        self.accepted_tokens = Counter("specdecode_draft_accepted_tokens", "Draft tokens accepted by the target.",
                                       registry=r)
        self.verification_steps = Counter("specdecode_verification_steps", "Row-steps of target verification.",
                                          registry=r)
        self.acceptance_rate = Gauge("specdecode_acceptance_rate", "Accepted / proposed draft tokens since the "
                                     "server started.", registry=r)
        self.mean_accepted_length = Gauge("specdecode_mean_accepted_length", "Tokens emitted per target "
                                          "verification and row since the server started.", registry=r)
        self.batches = Counter("specdecode_batches", "Engine batches run.", registry=r)
        self.cancelled = Counter("specdecode_cancelled_requests", "Generation requests cancelled, by reason.",
                                 ["reason"], registry=r)
        self.rejected = Counter("specdecode_rejected_requests", "Generation requests refused, by reason.",
                                ["reason"], registry=r)
        self.queue_depth = Gauge("specdecode_queue_depth", "Generation requests waiting for the engine.",
                                 registry=r)
        self.running = Gauge("specdecode_running_requests", "Generation requests in the engine's current batch.",
                             registry=r)
        self.in_flight = Gauge("specdecode_in_flight_requests", "HTTP requests being handled.", registry=r)
        self._lock = threading.Lock()
        self._totals = [0, 0, 0, 0]  # proposed, accepted, emitted after the first token, verification steps

    def observe_batch(self, stats, batch_size: int) -> None:
        """Called by the engine worker once per finished batch with the engine's Stats."""
        self.batches.inc()
        self.batch_size.observe(batch_size)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.proposed_tokens.inc(stats.proposed_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        self.verification_steps.inc(stats.verification_steps)
        with self._lock:
            t = self._totals
            t[0] += stats.proposed_tokens
            t[1] += stats.accepted_tokens
            t[2] += stats.new_tokens - stats.num_rows_with_first_token
            t[3] += stats.verification_steps
            if t[0]:
                self.acceptance_rate.set(t[1] / t[0])
            if t[3]:
                self.mean_accepted_length.set(t[2] / t[3])

    def render(self) -> bytes:
        return generate_latest(self.registry)
