"""What a soak learns of a server's memory: /metrics read into figures, RSS over time judged against its bounds,
and what each bounded cache holds.

A cache that is still filling grows RSS just as a leak does, so a soak tells them apart only once every cache is at
its bound: `caches` reads what each holds, `filled` says whether each had reached its bound by the end of the
warm-up (one that had not leaves the growth after it ambiguous), and `memory_summary` measures growth only after that,
between idle points (the end of the warm-up, halfway, the end of the load: the server holds no request at any of
them, so no request's own memory counts): over the second half, and per request.
"""

from __future__ import annotations

from collections import defaultdict

WARMUP_FRACTION = 0.25  # memory is judged against its level once the first quarter of the run (the warm-up) is over
RSS_GROWTH_LIMIT = 0.10  # flat: the RSS after warm-up stays within 10% of the warm level
SECOND_HALF_LIMIT = 0.02  # at its bounds: the second half's RSS peak within 2% of the first half's
FULL = 0.9  # a token-bounded cache this close to its bound is full (an entry larger than the room left waits)

METRICS = {"process_resident_memory_bytes": "rss_bytes", "specdecode_prefix_cache_tokens": "cache_tokens",
           "specdecode_prefix_cache_max_tokens": "cache_max_tokens", "specdecode_prefix_cache_bytes": "cache_bytes",
           "specdecode_prefix_cache_entries": "cache_entries", "specdecode_prefix_cache_evictions": "cache_evictions",
           "specdecode_suffix_history_tokens": "history_tokens",
           "specdecode_suffix_history_max_tokens": "history_max_tokens",
           "specdecode_suffix_history_bytes": "history_bytes",
           "specdecode_grammar_cache_entries": "grammar_entries",
           "specdecode_grammar_cache_max_entries": "grammar_max_entries",
           "specdecode_token_texts_entries": "token_texts_entries",
           "specdecode_token_texts_max_entries": "token_texts_max_entries",
           "specdecode_running_requests": "running", "specdecode_queue_depth": "queued",
           "specdecode_malloc_in_use_bytes": "malloc_bytes", "specdecode_malloc_free_bytes": "malloc_free_bytes"}


def scrape(text: str) -> dict:
    """The memory figures of one /metrics text (summed over replicas when the server has several)."""
    from prometheus_client.parser import text_string_to_metric_families

    figures: dict = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in METRICS:
                figures[METRICS[sample.name]] += sample.value
    return dict(figures)


def caches(sample: dict) -> dict:
    """What each bounded cache holds in one scrape, beside the process's RSS and what malloc holds."""
    mib = 2 ** -20
    return {
        "prefix_cache": {"entries": sample.get("cache_entries", 0), "tokens": sample.get("cache_tokens", 0),
                         "max_tokens": sample.get("cache_max_tokens", 0), "mib": sample.get("cache_bytes", 0) * mib,
                         "evictions": sample.get("cache_evictions", 0)},
        "suffix_history": {"tokens": sample.get("history_tokens", 0), "max_tokens": sample.get("history_max_tokens", 0),
                           "mib": sample.get("history_bytes", 0) * mib},
        "grammar_cache": {"entries": sample.get("grammar_entries", 0),
                          "max_entries": sample.get("grammar_max_entries", 0)},
        "token_texts": {"entries": sample.get("token_texts_entries", 0),
                        "max_entries": sample.get("token_texts_max_entries", 0)},
        "rss_mib": sample.get("rss_bytes", 0) * mib, "malloc_in_use_mib": sample.get("malloc_bytes", 0) * mib,
        "malloc_free_mib": sample.get("malloc_free_bytes", 0) * mib}


def filled(samples: list[dict]) -> dict:
    """Per bounded cache in use, whether it reached its bound in these scrapes (None: off or unused). Once at its
    bound a cache stays there, evicting (the least recently used out first), though it may then hold less than its
    bound by up to an entry: so the most it held counts. The prefix cache counts as full once it has evicted: on
    llama.cpp its spare rows bound it before its tokens do."""
    def most(key: str) -> float:
        return max((x.get(key, 0) for x in samples), default=0)

    found = {}
    if most("cache_max_tokens"):
        found["prefix_cache"] = most("cache_evictions") > 0 or most("cache_tokens") >= FULL * most("cache_max_tokens")
    if most("history_max_tokens") and most("history_tokens"):
        found["suffix_history"] = most("history_tokens") >= FULL * most("history_max_tokens")
    if most("grammar_max_entries"):
        found["grammar_cache"] = most("grammar_entries") >= most("grammar_max_entries")
    return found


def memory_summary(samples: list[dict], duration_s: float, warm: dict | None = None, end: dict | None = None,
                   measured_requests: int = 0, half: dict | None = None, second_half_requests: int = 0) -> dict:
    """RSS's peak during warm-up against its peak after it; the second half's growth, between the idle scrapes
    halfway (`half`) and after the load (`end`) where the soak paused for them, and its peak under load against the
    first half's (after the warm-up; peaks hold requests in flight); the caches' largest size against their bounds;
    and what the server kept per request between the idle scrapes at the end of the warm-up (`warm`) and after the
    load. duration_s: when the load ended (seconds from its start, like the samples' t_s)."""
    warm_end = warm["t_s"] if warm else WARMUP_FRACTION * duration_s
    rss = [x for x in samples if "rss_bytes" in x]
    before = [x for x in rss if x["t_s"] <= warm_end]
    after = [x for x in rss if x["t_s"] > warm_end]
    summary: dict = {"samples": len(samples)}
    if before and after:
        level = max(x["rss_bytes"] for x in before)  # the warm level: what warm-up reached
        peak = max(x["rss_bytes"] for x in after)
        summary.update(rss_warm_mib=level / 2**20, rss_peak_after_warmup_mib=peak / 2**20,
                       rss_last_mib=after[-1]["rss_bytes"] / 2**20, rss_growth=(peak - level) / level)
        if before[-1].get("malloc_bytes") and after[-1].get("malloc_bytes"):  # what malloc holds (glibc servers)
            summary.update(malloc_warm_mib=before[-1]["malloc_bytes"] / 2**20,
                           malloc_last_mib=after[-1]["malloc_bytes"] / 2**20)
    middle = half["t_s"] if half else duration_s / 2
    first = [x for x in rss if warm_end < x["t_s"] < middle]
    second = [x for x in rss if middle <= x["t_s"] <= duration_s]
    if first and second:
        top, high = max(x["rss_bytes"] for x in first), max(x["rss_bytes"] for x in second)
        summary.update(rss_first_half_peak_mib=top / 2**20, rss_second_half_peak_mib=high / 2**20,
                       rss_second_half_min_mib=min(x["rss_bytes"] for x in second) / 2**20,
                       rss_second_half_peak_growth=(high - top) / top)
    growth = {}
    for name, key in (("rss", "rss_bytes"), ("malloc", "malloc_bytes")):
        if half and end and half.get(key) and end.get(key):
            growth[name] = (end[key] - half[key]) / half[key]
            summary[f"{name}_second_half_growth"] = growth[name]
            if second_half_requests:
                summary[f"{name}_second_half_kib_per_request"] = (end[key] - half[key]) / 1024 / second_half_requests
        if warm and end and measured_requests and warm.get(key) and end.get(key):
            summary[f"{name}_kib_per_request"] = (end[key] - warm[key]) / 1024 / measured_requests
    if measured_requests:
        summary.update(measured_requests=measured_requests, second_half_requests=second_half_requests)
    judged = growth.get("rss", summary.get("rss_second_half_peak_growth"))  # idle to idle where the soak paused
    if judged is not None:
        summary["second_half_flat"] = judged <= SECOND_HALF_LIMIT
    for name in ("cache", "history"):
        held = [x.get(f"{name}_tokens", 0) for x in samples]
        bound = max((x.get(f"{name}_max_tokens", 0) for x in samples), default=0)
        summary[f"{name}_tokens_max"] = max(held, default=0)
        summary[f"{name}_max_tokens"] = bound
        summary[f"{name}_within_bound"] = not bound or max(held, default=0) <= bound
    grammar_bound = max((x.get("grammar_max_entries", 0) for x in samples), default=0)
    summary["grammar_within_bound"] = not grammar_bound or all(
        x.get("grammar_entries", 0) <= grammar_bound for x in samples)
    summary["flat"] = summary.get("rss_growth") is not None and summary["rss_growth"] <= RSS_GROWTH_LIMIT
    last = samples[-1] if samples else {}
    summary["drained"] = bool(samples) and not last.get("running") and not last.get("queued")
    if warm is not None:
        summary["filled_in_warmup"] = filled([x for x in samples if x["t_s"] <= warm_end])
    if end is not None:
        summary["caches_at_end"] = caches(end)
    return summary
