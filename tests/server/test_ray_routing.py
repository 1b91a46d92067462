"""Which Ray Serve replica answers (``server.ray_routing``): the state key, rendezvous hashing, and the
router's rules on fake replicas (the real deployment: tests/bulk/test_bulk_ray.py)."""

from __future__ import annotations

import asyncio
import collections
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from clef_gguf.server import ray_routing, routed  # noqa: E402
from clef_gguf.server.ray_routing import ATTEMPT, KEY, ROUTE, StateAffinityRouter, rendezvous, state_key  # noqa: E402


def test_the_key_is_the_rendered_state_and_its_media_whatever_the_questions():
    a = state_key(json.dumps({"state": {"b": 1, "a": [1, 2]}, "questions": {"x": {"type": "noul"}}}).encode())
    b = state_key(json.dumps({"questions": {"y": {"type": "score"}}, "state": {"a": [1, 2], "b": 1}}).encode())
    assert a == b and len(a) == 64  # keys sorted as the prompt renders them; the questions do not count
    assert state_key(b'{"state": "x", "questions": {}}') != state_key(b'{"state": "x ", "questions": {}}')
    plain = state_key(b'{"state": "x", "questions": {}}')
    assert state_key(b'{"state": "x", "images": ["data:image/png;base64,AAAA"], "questions": {}}') != plain
    assert state_key(b'{"state": "x", "videos": ["clip.mp4"], "questions": {}}') != plain
    for body in (b"{oops", b"[1, 2]", b'{"questions": {}}', b'{"state": [{"id": "a", "text": "t"}]}', b"\xff"):
        assert state_key(body) is None  # not one request with a state: no key, the replica says what is wrong


def test_rendezvous_moves_only_the_keys_of_a_replica_that_leaves():
    keys = [f"state-{i}" for i in range(300)]
    three = {k: rendezvous(k, ["a", "b", "c"])[0] for k in keys}
    assert set(collections.Counter(three.values())) == {"a", "b", "c"}
    two = {k: rendezvous(k, ["a", "c"])[0] for k in keys}
    assert all(two[k] == three[k] for k in keys if three[k] != "b")  # only b's keys moved
    assert rendezvous("k", ["c", "a", "b"]) == rendezvous("k", ["a", "b", "c"])  # order-free


class FakeReplica:
    def __init__(self, rid: str) -> None:
        self.replica_id = SimpleNamespace(unique_id=rid)
        self.routing_stats: dict = {}


def _router(mode="state", imbalance=2, loads=None):
    router = StateAffinityRouter.__new__(StateAffinityRouter)  # the rules alone: no Ray Serve around them
    router.initialize_state(mode=mode, imbalance=imbalance)
    loads = loads if loads is not None else {}
    router._replica_queue_len_cache = SimpleNamespace(get=lambda rid: loads.get(rid.unique_id))
    return router, loads


def _choose(router, replicas, **kwargs):
    pending = SimpleNamespace(kwargs=kwargs, routing_context=SimpleNamespace(should_backoff=False))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks], pending


def test_a_state_goes_to_its_replica_then_the_next_in_its_order():
    replicas = [FakeReplica(x) for x in "abc"]
    router, _ = _router()
    ranks, pending = _choose(router, replicas, **{KEY: "k1", ROUTE: "r1"})
    assert ranks == [rendezvous("k1", ["a", "b", "c"])[:1], rendezvous("k1", ["a", "b", "c"])[1:]]
    assert pending.routing_context.should_backoff  # every replica full: back off and ask again
    assert _choose(router, list(reversed(replicas)), **{KEY: "k1", ROUTE: "r2"})[0][0] == ranks[0]


def test_a_replica_far_busier_than_the_least_busy_is_passed_over():
    replicas = [FakeReplica(x) for x in "abc"]
    home = rendezvous("k", ["a", "b", "c"])[0]
    router, loads = _router(imbalance=2, loads={"a": 1, "b": 1, "c": 1})
    loads[home] = 3  # two more than the least busy: still its replica
    assert _choose(router, replicas, **{KEY: "k", ROUTE: "r"})[0][0] == [home]
    loads[home] = 4  # three more: the least busy first
    ranks, _ = _choose(router, replicas, **{KEY: "k", ROUTE: "r"})
    assert len(ranks) == 1 and ranks[0][-1] == home and set(ranks[0]) == {"a", "b", "c"}


def test_no_key_goes_to_the_least_busy_and_spread_draws_two():
    replicas = [FakeReplica(x) for x in "abc"]
    router, _ = _router(loads={"a": 5, "b": 0, "c": 2})
    assert _choose(router, replicas, **{ROUTE: "r"})[0] == [["b", "c", "a"]]
    spread, _ = _router(mode="spread")
    ranks, _ = _choose(spread, replicas, **{KEY: "k", ROUTE: "r"})
    assert len(ranks) == 1 and len(ranks[0]) == 2 and set(ranks[0]) <= {"a", "b", "c"}


def test_a_retry_keeps_off_the_replica_its_first_attempt_died_on_and_choices_are_counted_once(monkeypatch):
    monkeypatch.setattr(routed, "_counts", collections.Counter())
    replicas = [FakeReplica(x) for x in "ab"]
    router, _ = _router()
    home = rendezvous("k", ["a", "b"])[0]
    other = ({"a", "b"} - {home}).pop()
    _choose(router, replicas, **{KEY: "k", ROUTE: "r"})
    _choose(router, replicas, **{KEY: "k", ROUTE: "r"})  # asked again (all full): not counted twice
    router.on_request_routed(SimpleNamespace(kwargs={KEY: "k", ROUTE: "r"}), SimpleNamespace(unique_id=home), None)
    assert routed.counts() == {"affinity": 1}
    # the replica died: the second attempt of the same request is ranked without it
    assert _choose(router, replicas, **{KEY: "k", ROUTE: "r", ATTEMPT: 1})[0] == [[other]]
    router.on_request_routed(SimpleNamespace(kwargs={KEY: "k", ROUTE: "r", ATTEMPT: 1}),
                             SimpleNamespace(unique_id=other), None)
    assert routed.counts() == {"affinity": 2, "retry_elsewhere": 1}
    # with no other replica left, the retry goes where it can
    assert _choose(router, replicas[:1] if replicas[0].replica_id.unique_id == home else replicas[1:],
                   **{KEY: "k", ROUTE: "r", ATTEMPT: 1})[0] == [[home]]


def test_the_replicas_stats_are_kept_and_a_dead_replicas_forgotten(monkeypatch):
    monkeypatch.setattr(routed, "_replicas", {})
    monkeypatch.setattr(routed, "_counts", collections.Counter({"affinity": 3}))
    a, b = FakeReplica("a"), FakeReplica("b")
    a.routing_stats = {"pid": 11, "state_cache_hits": 4, "decisions": 5}
    b.routing_stats = {"pid": 12, "state_cache_hits": 1, "decisions": 2}
    routed.keep_stats({r.replica_id.unique_id: r.routing_stats for r in (a, b)})
    text = routed.exposition()[0].decode()
    assert 'clef_replica_state_cache_hits_total{replica="a"} 4.0' in text and "clef_state_cache_hits_total 5.0" in text
    assert 'clef_replica_info{pid="12",replica="b"} 1.0' in text and 'clef_routing_total{choice="affinity"} 3.0' in text
    routed.keep_stats({"a": a.routing_stats})  # b died
    text = routed.exposition()[0].decode()
    assert 'replica="b"' not in text and "clef_decisions_total 5.0" in text
    assert ray_routing.REMEMBERED > 0
