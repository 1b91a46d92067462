"""Which Ray Serve replica answers a request: the one holding its state, unless that one is far busier.

A replica's state cache (``tower/cache.py``) makes a state it has decoded before cost almost nothing the
next time, so requests about one state (one ticket asked several question sets) should meet the same
replica. Ray Serve's own router spreads requests without regard to that. :class:`StateAffinityRouter`
instead ranks the replicas by rendezvous hashing of the request's state key (each key's replica is the
one that scores highest for it: every router instance, in every ingress process, agrees with no shared
state, and when a replica dies or comes back only that replica's keys move). It falls back to the least
busy replica when the key's replica has ``imbalance`` more requests in flight than the least busy one, and
skips, on a retried request, the replica its first attempt died on.

The key is the state as the prompt renders it (``pipeline.encode.render``) and the request's pictures and
videos as given: what the state cache keys on, as text, without tokenizing (:func:`state_key`). Requests
without one (``GET /health``, a batch of states) go to the least busy replica.

What the routers chose, and what each replica reports (``ClefReplica.record_routing_stats``: its state
cache's hits, its decisions), are kept in ``server.routed`` for the ingress's ``GET /metrics``: not here,
since Ray Serve ships this module to the router's process by value (a copy of its globals).
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from clef_gguf.pipeline.encode import render
from clef_gguf.server.routed import count, keep_stats
from clef_gguf.server.settings import DEFAULT_IMBALANCE

KEY = "state_key"  # the keyword arguments the ingress passes with a request
ROUTE = "route_id"
ATTEMPT = "attempt"
REMEMBERED = 4096  # requests whose replica a router remembers, for their retry

def state_key(body: bytes) -> str | None:
    """The routing key of a request body: a digest of its rendered state and its media as given; None
    where the body is not one request with a state (not JSON, a batch of states, ``{"requests": [...]}``)."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None  # the replica refuses it, naming the problem
    if not isinstance(request, dict) or "state" not in request or isinstance(request["state"], list):
        return None
    digest = hashlib.sha256(render(request["state"]).encode("utf-8", "surrogatepass"))
    for kind in ("images", "videos"):
        for item in request.get(kind) or ():
            digest.update(f"\x00{kind}\x00".encode())
            digest.update(hashlib.sha256(render(item).encode("utf-8", "surrogatepass")).digest())
    return digest.hexdigest()


def rendezvous(key: str, replicas: Sequence[str]) -> list[str]:
    """Replica ids in the key's order of preference (highest random weight first)."""
    return sorted(replicas, key=lambda rid: hashlib.blake2b(f"{key}\x00{rid}".encode(), digest_size=8).digest(),
                  reverse=True)


class StateAffinityRouter(RequestRouter):
    """Ray Serve's ``RequestRouter`` for ``ClefReplica``: state affinity with a load guard (``mode``
    "state"), or Ray Serve's own rule, the less busy of two replicas drawn at random ("spread", for
    comparison); either way a retry avoids the replica its first attempt died on, and the replicas'
    stats are kept for the ingress's ``/metrics``."""

    def initialize_state(self, mode: str = "state", imbalance: int = DEFAULT_IMBALANCE, **_kwargs: Any) -> None:
        self.mode, self.imbalance = mode, int(imbalance)
        self._routed: collections.OrderedDict[str, str] = collections.OrderedDict()  # route id -> replica
        self._chosen: collections.OrderedDict[str, str] = collections.OrderedDict()  # route id -> its choice

    def _in_flight(self, replica: RunningReplica) -> int:
        known = self.replica_queue_len_cache.get(replica.replica_id)
        return int(known) if known is not None else 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        key, route, attempt = kwargs.get(KEY), kwargs.get(ROUTE), int(kwargs.get(ATTEMPT) or 0)
        candidates = list(candidate_replicas)
        if attempt and route is not None:  # a retry: not where the first attempt died, while others exist
            failed = self._routed.get(route)
            candidates = [r for r in candidates if r.replica_id.unique_id != failed] or candidates
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: wait, then ask again
        choice, ranks = self._rank(key, candidates)
        if route is not None:  # counted once placed; asked again while every replica is full, the last counts
            self._chosen[route] = choice
            while len(self._chosen) > REMEMBERED:  # requests cancelled before they were placed
                self._chosen.popitem(last=False)
        return ranks

    def _rank(self, key: str | None, candidates: list[RunningReplica]) -> tuple[str, list[list[RunningReplica]]]:
        """(the choice's name, the replicas in ranks: the base router takes the least busy of the first
        rank that has room)."""
        if self.mode == "spread":
            return "spread", [random.sample(candidates, min(2, len(candidates)))]
        by_load = sorted(candidates, key=self._in_flight)
        if not key:
            return "no_key", [by_load]
        by_id = {r.replica_id.unique_id: r for r in candidates}
        ranked = [by_id[rid] for rid in rendezvous(key, list(by_id))]
        if self._in_flight(ranked[0]) - self._in_flight(by_load[0]) > self.imbalance:
            return "least_busy", [by_load]
        return "affinity", [[ranked[0]], ranked[1:]] if len(ranked) > 1 else [ranked]  # full: the next in order

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        route = pending_request.kwargs.get(ROUTE)
        if route is None:
            return
        count(self._chosen.pop(route, "unknown"))
        if int(pending_request.kwargs.get(ATTEMPT) or 0) and self._routed.get(route) != replica_id.unique_id:
            count("retry_elsewhere")
        self._routed[route] = replica_id.unique_id
        while len(self._routed) > REMEMBERED:
            self._routed.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        keep_stats({r.replica_id.unique_id: dict(r.routing_stats or {}) for r in replicas})
