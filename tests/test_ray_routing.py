"""Cache-aware routing: the ring and its load bound (no Ray), then on a local Ray instance (2 CPUs, tiny models) a
multi-turn chat workload on 2 replicas keeps one server's share of later-turn prompt tokens served from cache,
answers exactly as one server does, and a lost replica's conversations re-home and are answered."""

from __future__ import annotations

import asyncio
import collections
import json
import time

import httpx
import pytest

from specdecode.server.routing import HashRing, Homes, load_bound, place, routing_key


def _chat(*messages: tuple[str, str]) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}).encode()


def test_a_conversations_turns_share_one_key_and_conversations_differ():
    turn1 = routing_key("/v1/chat/completions", _chat(("system", "s"), ("user", "q1")))
    turn3 = routing_key("/v1/chat/completions", _chat(("system", "s"), ("user", "q1"), ("assistant", "a"),
                                                      ("user", "q2"), ("assistant", "b"), ("user", "q3")))
    other = routing_key("/v1/chat/completions", _chat(("system", "s"), ("user", "another")))
    assert turn1 == turn3 != other
    long = "x" * 5000
    assert routing_key("/v1/completions", json.dumps({"prompt": long}).encode()) == \
        routing_key("/v1/completions", json.dumps({"prompt": long + " more turns"}).encode())
    for bad in (b"{not json", b"[]", b'{"prompt": 3}', b"", b'{"messages": []}'):
        assert routing_key("/v1/completions", bad) is None


def test_ring_rehomes_only_a_lost_replicas_keys_and_the_load_bound_spills():
    keys = [f"conversation {i}" for i in range(2000)]
    three = HashRing(["a", "b", "c"])
    homes = {k: three.walk(k)[0] for k in keys}
    spread = collections.Counter(homes.values())
    assert min(spread.values()) > 0.25 * len(keys)  # each of 3 near a third
    two = HashRing(["a", "c"])
    for k in keys:
        if homes[k] != "b":
            assert two.walk(k)[0] == homes[k]  # nobody else's conversation moves
        else:
            assert two.walk(k)[0] in ("a", "c")
    key = keys[0]
    home = three.walk(key)[0]
    order, by = place(three, key, {})
    assert order[0] == home and sorted(order) == ["a", "b", "c"] and by == "affinity"
    hot = {"a": 0, "b": 0, "c": 0, home: 10}  # the home holds over 1.25 x the mean: the key spills to the next
    assert load_bound(hot) == 5 and load_bound(hot, floor=8) == 8
    order, by = place(three, key, hot)
    assert by == "load" and order[0] == three.walk(key)[1]
    assert place(three, key, hot, floor=11)[1] == "affinity"  # within a batch's worth: not hot
    assert place(three, key, {}, policy="load")[1] == "load"


def test_a_served_key_stays_with_its_replica_when_another_joins():
    """The first turns of a deployment can arrive while only one replica is up (measured on llama.cpp: all 6 chats'
    first turns on one replica); the second replica joining must not move a conversation under way away from the
    cache that holds it. New keys still spread by the ring, and a lost replica's keys re-home."""
    keys = [f"conversation {i}" for i in range(200)]
    one, two = HashRing(["a"]), HashRing(["a", "b"])
    homes = Homes(max_keys=150)
    for k in keys:
        order, by = place(one, k, {}, last=homes.get(k))
        homes.served(k, order[0])
    moved = [k for k in keys[50:] if two.walk(k)[0] == "b"]  # the ring alone would send these to b
    assert len(moved) > 30
    for k in moved:
        order, by = place(two, k, {}, last=homes.get(k))
        assert order[0] == "a" and by == "affinity"
    assert homes.get(keys[0]) is None  # the least recently served key was forgotten (150 at most)
    fresh = [f"new conversation {i}" for i in range(200)]
    assert {place(two, k, {}, last=homes.get(k))[0][0] for k in fresh} == {"a", "b"}
    assert place(HashRing(["b"]), moved[0], {}, last=homes.get(moved[0]))[0] == ["b"]  # a gone: re-homed
    hot = {"a": 10, "b": 0}  # its replica is hot: the load bound still spills it
    assert place(two, moved[0], hot, last="a") == (["b", "a"], "load")


# ---------------------------------------------------------------------------------------------- on Ray Serve
SYSTEM = "You review Python code. Answer briefly. " * 6
QUESTIONS = ["def quicksort(arr): return arr", "import numpy as np", "class Model: pass", "for i in range(3): print(i)",
             "x = [1, 2, 3]", "print('hello world')"]


@pytest.fixture(scope="module")
def ray_url():
    pytest.importorskip("ray.serve")
    import ray
    from ray import serve

    from specdecode.server.ray_serve import http_options
    from test_server_helpers import free_port

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    serve.start(http_options=http_options("127.0.0.1", port))
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _deploy(tiny_model_dirs, url: str, replicas: int, routing: str) -> None:
    from ray import serve

    from specdecode.pairing.pair import ModelOptions
    from specdecode.server import ServerSettings
    from specdecode.server.ray_serve import build_application, deployment_options, replica_config
    from test_server_helpers import wait_until

    settings = ServerSettings(max_batch_size=8, max_queue=32, max_tokens_limit=64, request_timeout=60)
    opts = ModelOptions(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"], k=4,
                        draft_quantize="none", threads=1)
    options = deployment_options(replicas=replicas, settings=settings, cpus_per_replica=1)
    serve.run(build_application(replica_config(opts, settings, "tiny-target"), routing=routing, **options),
              name="specdecode", route_prefix="/")

    def healthy():
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(healthy, 60, 0.2)
    # Ray reports the application ready before the ingress's router has heard of every replica: turns sent then all
    # go to the one it knows, and stay with their cache there (by design; see the test above). Each metrics scrape
    # asks the router, which takes the live replicas; wait until it names them all.
    assert wait_until(lambda: len(_replicas_scraped(url)) == replicas, 60, 0.2)


def _replicas_scraped(url: str) -> set:
    """The replicas whose metrics the ingress's /metrics holds (those its router knows as live)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return set()
    return {s.labels["replica"] for f in text_string_to_metric_families(text) for s in f.samples
            if "replica" in s.labels and not s.name.startswith("specdecode_rout")}


def _chats(url: str, turns: range, conversations: int = 6, history: dict | None = None) -> dict:
    """Each conversation's turns (in order; conversations at once): {conversation: [(answer, prompt, cached)]}."""
    history = history if history is not None else {c: [] for c in range(conversations)}

    async def conversation(http, c):
        messages = [{"role": "system", "content": f"[chat {c}] {SYSTEM}"}]
        for turn, (answer, _, _) in enumerate(history[c]):
            messages += [{"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]},
                         {"role": "assistant", "content": answer}]
        for turn in turns:
            messages.append({"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]})
            r = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12,
                                                              "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            usage = body["usage"]
            answer = body["choices"][0]["message"]["content"]
            history[c].append((answer, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
            messages.append({"role": "assistant", "content": answer})

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            await asyncio.gather(*(conversation(http, c) for c in history))

    asyncio.run(run())
    return history


def _later_turn_share(history: dict) -> float:
    later = [t for turns in history.values() for t in turns[1:]]
    return sum(cached for _, _, cached in later) / sum(prompt for _, prompt, _ in later)


def _metric(text: str, name: str) -> dict:
    """{labels (sorted tuple): value} of a metric's samples in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def test_affinity_keeps_one_servers_cache_share_and_a_lost_replica_rehomes(ray_url, tiny_model_dirs):
    import ray

    shares, histories = {}, {}
    for label, replicas, routing, turns in (("one", 1, "affinity", 4), ("load", 2, "load", 3),
                                            ("affinity", 2, "affinity", 3)):
        _deploy(tiny_model_dirs, ray_url, replicas, routing)
        histories[label] = _chats(ray_url, range(turns))
        shares[label] = _later_turn_share({c: h[:3] for c, h in histories[label].items()})
    print(f"\nlater-turn prompt tokens from cache: one server {shares['one']:.2f}, 2 replicas by load "
          f"{shares['load']:.2f}, 2 replicas by prefix affinity {shares['affinity']:.2f}")
    metrics = httpx.get(f"{ray_url}/metrics", timeout=30).text
    routed = _metric(metrics, "specdecode_routed_requests_total")
    assert shares["one"] > 0.5
    assert shares["affinity"] >= 0.9 * shares["one"], routed

    def answers(label, turns=3):
        return {c: [t[0] for t in h[:turns]] for c, h in histories[label].items()}

    assert answers("affinity") == answers("one") == answers("load")  # greedy: the same wherever served

    replicas = {dict(labels)["replica"] for labels in routed}
    assert len(replicas) == 2 and sum(routed.values()) == 18
    assert sum(v for labels, v in routed.items() if dict(labels)["by"] == "affinity") >= 12
    print("routed:", {tuple(dict(k).values()): v for k, v in routed.items()})
    hits = _metric(metrics, "specdecode_prefix_cache_hit_tokens")
    assert {dict(labels)["replica"] for labels in hits} == replicas and sum(hits.values()) > 0

    # a replica lost between turns: its conversations re-home to the other and are answered as one server does
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::specdecode#specdecode#"))
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    start = time.monotonic()
    _chats(ray_url, range(3, 4), history=histories["affinity"])
    assert answers("affinity", 4) == answers("one", 4)
    print(f"after a replica kill, the 4th turns of 6 conversations answered in {time.monotonic() - start:.1f} s")
