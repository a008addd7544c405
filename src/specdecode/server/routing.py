"""Cache-aware routing across replicas: bounded-load consistent hashing of a request's prefix.

A replica's prefix cache and suffix history hold what it has seen, so a conversation's next turn is cheapest on the
replica that served its last one. The key of a request names its prefix: a chat's messages up to its first user
message (the system prompt and the opening question, which every later turn repeats), or a completion prompt's
first PREFIX_CHARS characters. Keys hash onto a ring of the live replicas (VIRTUAL_NODES points each), and a key's
home is the first replica clockwise of it: a replica that joins or leaves moves only its own keys.

The load bound (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018): no replica takes
a request while it holds ceil(LOAD_BOUND x mean load) or more of the requests in flight (this one counted), nor
fewer than its batch size (requests within a batch decode together: below it a replica is not hot); the key then
walks on clockwise to the first replica under the bound. That spill is itself consistent (a hot conversation
always spills to the same second replica), and the count of requests placed by affinity vs by load is exported.

A key that has been served is homed where it was last served (Homes, bounded), not where the ring says now: a
replica that joins (a deployment's second replica coming up after the first requests, autoscaling) takes new keys
from the ring, but a conversation already under way stays with the replica that holds its cache. Without this,
measured on llama.cpp: the first turns of 6 chats all went to the one replica up at the start, and when the second
came up the ring moved 2-3 of them to it, whose second turns found nothing cached (0.82x one server's share).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
import threading
from collections import Counter, OrderedDict
from typing import Hashable, Iterable, Sequence

PREFIX_CHARS = 512  # a completion prompt's first characters (a few KV blocks of text) name its prefix
PREFIX_TOKEN_IDS = 128  # the same for a prompt given as token ids
VIRTUAL_NODES = 160  # points per replica on the ring: keys spread within a few % of evenly
LOAD_BOUND = 1.25  # c: no replica above c x the mean requests in flight (rounded up)
POLICIES = ("affinity", "load")
MAX_HOMES = 100_000  # keys whose last replica is remembered (least recently served forgotten first)


def routing_key(path: str, body: bytes | str) -> str | None:
    """The prefix key of a generation request's raw JSON body; None when it has none (not JSON, no prompt): such a
    request goes by load (a bad body is answered 400 by whichever replica gets it)."""
    try:
        request = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    model = request.get("model")
    model = model if isinstance(model, str) else ""
    if path.rstrip("/").endswith("/chat/completions"):
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        opening = []
        for message in messages:
            opening.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break  # later turns repeat everything up to here
        return "chat\0" + model + "\0" + json.dumps(opening, sort_keys=True, default=str)
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str) and prompt:
        return "text\0" + model + "\0" + prompt[:PREFIX_CHARS]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:PREFIX_TOKEN_IDS]):
        return "ids\0" + model + "\0" + ",".join(map(str, prompt[:PREFIX_TOKEN_IDS]))
    return None


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class HashRing:
    """The live replicas' points on a 64-bit ring."""

    def __init__(self, replicas: Iterable[Hashable], virtual_nodes: int = VIRTUAL_NODES):
        self.replicas = sorted(set(replicas), key=str)
        points = sorted((_point(f"{r}#{v}"), str(r), r) for r in self.replicas for v in range(virtual_nodes))
        self._hashes = [p[0] for p in points]
        self._owners = [p[2] for p in points]

    def walk(self, key: str) -> list:
        """Every replica once, in the order met clockwise from the key's point: its home first."""
        if not self.replicas:
            return []
        start = bisect.bisect(self._hashes, _point(key))
        order, seen = [], set()
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in seen:
                seen.add(owner)
                order.append(owner)
                if len(order) == len(self.replicas):
                    break
        return order


def load_bound(loads: dict, bound: float = LOAD_BOUND, floor: int = 1) -> int:
    """The most requests in flight a replica may hold before it takes one more: c x the mean (this request
    counted), rounded up, and never under `floor` (a replica's batch: requests within it decode together, so a
    replica is not hot below it)."""
    return max(math.ceil(bound * (sum(loads.values()) + 1) / max(len(loads), 1)), floor)


class Homes:
    """The replica each key was last served by (at most max_keys keys, least recently served forgotten first)."""

    def __init__(self, max_keys: int = MAX_HOMES):
        self.max_keys = max_keys
        self._homes: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str | None):
        with self._lock:
            return self._homes.get(key) if key is not None else None

    def served(self, key: str | None, replica) -> None:
        if key is None:
            return
        with self._lock:
            self._homes[key] = replica
            self._homes.move_to_end(key)
            while len(self._homes) > self.max_keys:
                self._homes.popitem(last=False)


def place(ring: HashRing, key: str | None, loads: dict, policy: str = "affinity",
          bound: float = LOAD_BOUND, floor: int = 1, last=None) -> tuple[list, str]:
    """The replicas to try, best first, and how the first was chosen: "affinity" (the key's home), "load" (the
    home was at the bound, or the policy is load-only, or the request has no key). loads: requests in flight per
    live replica (the ring's replicas; a replica missing from it counts 0). last: the replica that served the key
    last (Homes), its home while it is live: the ring's choice may have moved since (a replica joined)."""
    loads = {r: loads.get(r, 0) for r in ring.replicas}
    by_load = sorted(ring.replicas, key=lambda r: (loads[r], random.random()))
    if policy == "load" or key is None:
        return by_load, "load"
    order = ring.walk(key)
    if last in loads:
        order = [last, *(r for r in order if r != last)]
    cap = load_bound(loads, bound, floor)
    for i, replica in enumerate(order):
        if loads[replica] < cap:
            rest = [r for r in by_load if r != replica]
            return [replica, *rest], "affinity" if i == 0 else "load"
    return by_load, "load"  # unreachable: the least loaded replica is always under ceil(c x mean), c >= 1


class RoutingStats:
    """Requests routed per replica and how (affinity or load), requests in flight, and re-routes after a replica
    was lost; shared by the router (which counts) and the ingress (which exports)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.routed: Counter = Counter()  # (replica, by) -> requests
        self.in_flight: Counter = Counter()  # replica -> requests
        self.rerouted = 0  # requests sent again after their replica was lost before answering
        self.live: tuple = ()  # the replicas the router last saw alive

    def routed_to(self, replica: str, by: str) -> None:
        with self._lock:
            self.routed[(replica, by)] += 1
            self.in_flight[replica] += 1

    def finished(self, replica: str) -> None:
        with self._lock:
            if self.in_flight[replica] > 0:
                self.in_flight[replica] -= 1

    def reroute(self) -> None:
        with self._lock:
            self.rerouted += 1

    def forget(self, live: Sequence[str]) -> None:
        """The live replicas are these: a lost replica's requests in flight are gone with it."""
        with self._lock:
            self.live = tuple(live)
            for replica in list(self.in_flight):
                if replica not in live:
                    del self.in_flight[replica]

    def snapshot(self) -> dict:
        with self._lock:
            return {"routed": dict(self.routed), "in_flight": dict(self.in_flight), "rerouted": self.rerouted,
                    "live": self.live}


_STATS = RoutingStats()


def routing_stats() -> RoutingStats:
    """This process's routing counts (the ingress's: its handle's router counts, its /metrics exports)."""
    return _STATS


def render_metrics(replica_texts: dict[str, str], stats: dict) -> str:
    """One Prometheus text of several replicas' metrics (each sample labelled with its replica's id) and the
    router's counts (stats: RoutingStats.snapshot())."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for replica, text in sorted(replica_texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            for sample in family.samples:
                merged.add_sample(sample.name, {"replica": replica, **sample.labels}, sample.value,
                                  sample.timestamp, sample.exemplar)
    routed = CounterMetricFamily("specdecode_routed_requests", "Generation requests the router sent to a replica, "
                                 "by how it chose: affinity (the prefix's home replica) or load.",
                                 labels=["replica", "by"])
    for (replica, by), count in sorted(stats["routed"].items()):
        routed.add_metric([replica, by], count)
    in_flight = GaugeMetricFamily("specdecode_routed_in_flight", "Requests routed to a replica and not yet "
                                  "answered.", labels=["replica"])
    for replica, count in sorted(stats["in_flight"].items()):
        in_flight.add_metric([replica], count)
    rerouted = CounterMetricFamily("specdecode_rerouted_requests", "Requests sent again after their replica was "
                                   "lost before answering.", value=stats["rerouted"])

    class Collected:
        def collect(self):
            yield from families.values()
            yield from (routed, in_flight, rerouted)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collected())
    return generate_latest(registry).decode()
