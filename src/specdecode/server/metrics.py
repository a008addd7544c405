"""Prometheus metrics of one app, in a registry of its own (so tests can build several apps in one process)."""

from __future__ import annotations

import collections
import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

from .allocator import malloc_bytes

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKENS_PER_S_WINDOW_S = 10.0  # the tokens/s gauge averages over this many seconds
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
        self.inter_token_latency = Histogram("specdecode_inter_token_latency_seconds", "Time between successive "
                                             "tokens of a row (a step that delivers n tokens of a row counts its "
                                             "interval / n, n times).", buckets=ITL_BUCKETS, registry=r)
        self.batch_size = Histogram("specdecode_batch_size", "Rows decoding in the engine, per engine step.",
                                    buckets=BATCH_BUCKETS, registry=r)
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
        self.steps = Counter("specdecode_engine_steps", "Engine steps run (one speculative step of every running "
                             "row, after admitting queued prompts).", registry=r)
        self.tokens_per_second = Gauge("specdecode_tokens_per_second", f"New tokens per second over the last "
                                       f"{TOKENS_PER_S_WINDOW_S:g} s.", registry=r)
        self.cancelled = Counter("specdecode_cancelled_requests", "Generation requests cancelled, by reason.",
                                 ["reason"], registry=r)
        self.step_failures = Counter("specdecode_engine_step_failures", "Engine steps that raised (their session "
                                     "was replaced; see specdecode_engine_step_retries).", registry=r)
        self.step_retries = Counter("specdecode_engine_step_retries", "Generation requests run again from their "
                                    "start, alone, after a step that decoded them raised.", registry=r)
        self.rejected = Counter("specdecode_rejected_requests", "Generation requests refused, by reason.",
                                ["reason"], registry=r)
        self.queue_depth = Gauge("specdecode_queue_depth", "Generation requests waiting for the engine.",
                                 registry=r)
        self.running = Gauge("specdecode_running_requests", "Generation requests in the engine (rows decoding or "
                             "being prefilled).", registry=r)
        self.running_rows = Gauge("specdecode_running_rows", "Rows decoding in the engine's batch.", registry=r)
        self.in_flight = Gauge("specdecode_in_flight_requests", "HTTP requests being handled.", registry=r)
        self._lock = threading.Lock()
        self._totals = [0, 0, 0, 0]  # proposed, accepted, emitted after the first token, verification steps
        self._window: collections.deque = collections.deque()  # (time, tokens) of recent steps

    def observe_step(self, rows: int, tokens: int, now: float) -> None:
        """Called by the engine worker after each step: rows decoding, tokens delivered, the time."""
        self.steps.inc()
        self.batch_size.observe(rows)
        self.generated_tokens.inc(tokens)
        window = self._window
        window.append((now, tokens))
        while window and now - window[0][0] > TOKENS_PER_S_WINDOW_S:
            window.popleft()
        span = now - window[0][0] if len(window) > 1 else 0.0
        if span > 0:
            self.tokens_per_second.set(sum(t for _, t in list(window)[1:]) / span)

    def observe_rows(self, row_stats, prompt_tokens: int) -> None:
        """Called by the engine worker once per finished request with its rows' RowStats."""
        self.prompt_tokens.inc(prompt_tokens)
        proposed = sum(r.proposed_tokens for r in row_stats)
        accepted = sum(r.accepted_tokens for r in row_stats)
        steps = sum(r.verification_steps for r in row_stats)
        emitted = sum(max(r.new_tokens - 1, 0) for r in row_stats)  # the first token comes from the prefill
        self.proposed_tokens.inc(proposed)
        self.accepted_tokens.inc(accepted)
        self.verification_steps.inc(steps)
        with self._lock:
            t = self._totals
            t[0] += proposed
            t[1] += accepted
            t[2] += emitted
            t[3] += steps
            if t[0]:
                self.acceptance_rate.set(t[1] / t[0])
            if t[3]:
                self.mean_accepted_length.set(t[2] / t[3])

    def watch_policy(self, policy_of) -> None:
        """Export the speculation policy's figures (policy_of() returns the policy, or None), read at each scrape."""
        self.registry.register(PolicyCollector(policy_of))

    def watch_prefix_cache(self, cache_of) -> None:
        """Export the prefix cache's counters (cache_of() returns it, or None when it is off)."""
        def figure(name):
            return lambda: (lambda c: c.stats.to_dict()[name] if c is not None else 0)(cache_of())

        for name, doc in (("hit_tokens", "Prompt tokens whose KV came from the prefix cache."),
                          ("prompt_tokens", "Prompt tokens looked up in the prefix cache."),
                          ("hit_rate", "Cached prompt tokens / prompt tokens looked up."),
                          ("hits", "Prompts that took a prefix from the cache."),
                          ("evictions", "Cached prefixes evicted (token budget or spare rows)."),
                          ("idle_prefilled_tokens", "Answers' tokens prefilled again while the server was idle, "
                                                    "so that later prompts take them from the cache exactly.")):
            Gauge(f"specdecode_prefix_cache_{name}", doc, registry=self.registry).set_function(figure(name))
        Gauge("specdecode_prefix_cache_entries", "Prefixes the prefix cache holds (finished rows' KV).",
              registry=self.registry).set_function(lambda: len(cache_of().entries) if cache_of() is not None else 0)
        Gauge("specdecode_prefix_cache_tokens", "Tokens of KV the prefix cache holds.",
              registry=self.registry).set_function(lambda: cache_of().tokens if cache_of() is not None else 0)
        Gauge("specdecode_prefix_cache_max_tokens", "The prefix cache's bound on the tokens it holds (0: off).",
              registry=self.registry).set_function(lambda: cache_of().max_tokens if cache_of() is not None else 0)
        Gauge("specdecode_prefix_cache_bytes", "Memory of the prefix cache's own copies of KV (backends whose "
              "cached prefixes stay in the model's cache hold 0 here).",
              registry=self.registry).set_function(lambda: cache_of().bytes if cache_of() is not None else 0)

    def watch_memory(self, drafter_of) -> None:
        """Export the process's memory (RSS) and the suffix draft's history of earlier requests (drafter_of()
        returns the drafter, or None), read at each scrape: a soak checks both stay flat, within their bounds."""
        from prometheus_client import ProcessCollector

        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, ... (on Linux)

        def history_of(drafter):  # a suffix draft's, or the suffix half's of suffix+MODEL
            found = getattr(drafter, "history", None)
            return found if found is not None else getattr(getattr(drafter, "suffix", None), "history", None)

        def history(name):
            return lambda: getattr(history_of(drafter_of()), name, 0) or 0

        for name, index, doc in (("in_use", 0, "Bytes the C allocator (glibc malloc) has handed out and not had back: "
                                               "torch tensors, the grammar engine's and the tokenizer's state."),
                                 ("free", 1, "Free bytes glibc malloc keeps inside its heaps (fragmentation): RSS that "
                                             "grows with this, and not with in_use, is the allocator's, not a leak.")):
            Gauge(f"specdecode_malloc_{name}_bytes", doc, registry=self.registry).set_function(
                lambda index=index: malloc_bytes()[index])
        for name, attribute, doc in (("tokens", "tokens", "Tokens the suffix draft's history holds."),
                                     ("max_tokens", "max_tokens", "The suffix draft history's bound on tokens."),
                                     ("bytes", "nbytes", "Memory of the suffix draft's history index.")):
            Gauge(f"specdecode_suffix_history_{name}", doc, registry=self.registry).set_function(history(attribute))

    def watch_caches(self, grammar_cache_of, token_texts, vocab_size: int | None) -> None:
        """Export what the other bounded caches hold, read at each scrape: a soak tells a cache filling up to its
        bound from a leak only when it knows each one's size (grammar_cache_of() returns the compiled grammars'
        cache_info(), or None before a request needed one; token_texts names the tokens of logprobs, one entry per
        token id, so the vocabulary bounds it)."""
        def grammars(field):
            return lambda: (lambda info: getattr(info, field) if info is not None else 0)(grammar_cache_of())

        Gauge("specdecode_grammar_cache_entries", "Compiled grammars kept (each distinct schema, regex or tool set).",
              registry=self.registry).set_function(grammars("currsize"))
        Gauge("specdecode_grammar_cache_max_entries", "The bound on compiled grammars kept (--grammar-cache; 0 "
              "before a request needed a grammar).", registry=self.registry).set_function(grammars("maxsize"))
        Gauge("specdecode_token_texts_entries", "Token ids whose text and bytes logprobs have named (at most the "
              "vocabulary).", registry=self.registry).set_function(lambda: len(token_texts))
        Gauge("specdecode_token_texts_max_entries", "The token-text cache's bound: the vocabulary's size.",
              registry=self.registry).set(vocab_size or 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PolicyCollector:
    """What the engine's speculation policy measured and decided (Policy.figures() and its one-line explanation),
    read when /metrics is scraped, so the numbers are the latest without the engine pushing them."""

    def __init__(self, policy_of):
        self.policy_of = policy_of

    def describe(self):
        return []  # nothing to check at registration: the families exist only once a policy does

    def collect(self):
        summary = _latest_summary(self.policy_of())
        if summary is None:
            return
        info = InfoMetricFamily("specdecode_policy", "The speculation policy and its explanation of its choice.")
        info.add_metric([], {"policy": summary["policy"], "explanation": summary["explanation"]})
        yield info
        if not summary["steps"]:
            return  # before any step the figures are priors: nothing measured to export
        yield _gauge("specdecode_policy_expected_speedup", "Speedup over plain decoding that Leviathan's formula "
                     "gives at the policy's measured costs and acceptance, for its best K (a fixed policy: its K).",
                     summary["expected_speedup"])
        yield _gauge("specdecode_policy_best_k", "The K with the highest expected speedup at the measured numbers.",
                     summary["best_k"])
        yield _gauge("specdecode_policy_draft_step_cost", "One draft step, in target steps (an estimate until "
                     "timed).", summary["draft_step_cost"])
        verify = GaugeMetricFamily("specdecode_policy_verify_cost", "A target forward of n tokens, in target steps "
                                   "(an estimate where n was not timed).", labels=["tokens"])
        for n, cost in summary["verify_cost"].items():
            verify.add_metric([str(n)], cost)
        yield verify
        if summary["acceptance_rate"] is not None:
            yield _gauge("specdecode_policy_acceptance_rate", "Drafts kept / drafts verified, recent steps weighted "
                         "more (the evidence the policy decides on).", summary["acceptance_rate"])
        if summary["target_step_s"] is not None:
            yield _gauge("specdecode_policy_target_step_seconds", "A plain target step (1 token) as the policy timed "
                         "it.", summary["target_step_s"])
        steps = GaugeMetricFamily("specdecode_policy_steps", "Engine steps by the K the policy chose (0 = plain).",
                                  labels=["k"])
        for k, n in summary["k_histogram"].items():
            steps.add_metric([str(k)], n)
        yield steps


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _latest_summary(policy, attempts: int = 3) -> dict | None:
    """policy.summary(), read from the HTTP thread while the engine thread may be updating it: a dict that grows
    during the read raises RuntimeError, and the next read sees a consistent state."""
    if policy is None or not hasattr(policy, "figures"):
        return None  # a policy of the user's own may not explain itself
    for _ in range(attempts):
        try:
            return policy.summary()
        except RuntimeError:
            continue
    return None
