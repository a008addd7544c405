"""PrefixAffinityRouter: Ray Serve's RequestRouter API placing requests by routing.place (bounded-load consistent
hashing of their prefix key). It runs in the process of the handle's caller (the ingress deployment), whose /metrics
exports routing_stats(). Imported only where Ray is."""

from __future__ import annotations

from ray.serve.request_router import RequestRouter

from specdecode.server.routing import LOAD_BOUND, HashRing, Homes, place, routing_stats

MAX_PENDING_CHOICES = 10_000

# Ray Serve pickles this module by value (to ship the router class): module state here would be copied, so the
# counts live in routing.py (pickled by reference), read through routing_stats().


class PrefixAffinityRouter(RequestRouter):
    """Each request's home replica on the ring of live replicas, under the load bound, first; the rest follow by
    load, so that Ray's probing falls back to them when the first is full (at max_ongoing_requests). A call with
    replica=ID (the ingress's metrics scrape) goes to that replica only."""

    def initialize_state(self, policy: str = "affinity", load_bound: float = LOAD_BOUND, load_floor: int = 1):
        self.policy, self.load_bound, self.load_floor = policy, load_bound, load_floor
        self._ring, self._ring_ids = HashRing(()), ()
        self._choices: dict = {}  # internal request id -> (first choice, how it was chosen, its key)
        self._routed: dict = {}  # internal request id -> the replica it went to, until it completes
        self._homes = Homes()  # key -> the replica that served it last: a joining replica takes only new keys

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        pinned = kwargs.get("replica")
        if pinned is not None:
            return [[by_id[pinned]]] if pinned in by_id else [candidate_replicas]
        # the ring of all live replicas, not this call's candidates: a key's home must not depend on who was asked
        live = tuple(sorted(rid.unique_id for rid in self.curr_replicas)) or tuple(sorted(by_id))
        if live != self._ring_ids:
            self._ring, self._ring_ids = HashRing(live), live
            routing_stats().forget(live)
        key = kwargs.get("routing_key")
        order, by = place(self._ring, key, routing_stats().snapshot()["in_flight"], self.policy, self.load_bound,
                          self.load_floor, self._homes.get(key))
        order = [by_id[r] for r in order if r in by_id]
        if not order:
            return [candidate_replicas]
        if pending_request is not None and "routing_key" in kwargs:  # a generation request: counted
            if len(self._choices) > MAX_PENDING_CHOICES:  # requests chosen for but never routed (cancelled)
                self._choices.clear()
            self._choices[pending_request.metadata.internal_request_id] = (order[0].replica_id.unique_id, by, key)
        return [order[:1], order[1:]] if len(order) > 1 else [order]

    def on_request_routed(self, pending_request, replica_id, result):
        request_id = pending_request.metadata.internal_request_id
        first, by, key = self._choices.pop(request_id, (None, None, None))
        if first is None:
            return  # a pinned call (a metrics scrape), not a generation request
        routing_stats().routed_to(replica_id.unique_id, by if replica_id.unique_id == first else "load")
        if self.policy != "load":
            self._homes.served(key, replica_id.unique_id)
        self._routed[request_id] = replica_id.unique_id

    def on_request_completed(self, replica_id, internal_request_id):
        if self._routed.pop(internal_request_id, None) is not None:
            routing_stats().finished(replica_id.unique_id)
