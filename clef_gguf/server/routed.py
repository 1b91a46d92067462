"""What this process's Ray Serve routers chose, and what each model replica last reported to them, for the
ingress's ``GET /metrics`` (``server.ray_serve``).

Kept apart from the router (``server.ray_routing``): Ray Serve ships the router's module to the process
that routes by value, with a copy of its globals, so counters kept there would not be the ones the
ingress reads. A replica that dies is forgotten here with its counts (the sums drop: Prometheus reads a
counter that goes down as one that restarted).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# What each replica reports (``ClefReplica.record_routing_stats``), in words.
SERIES = {"state_cache_hits": "state cache lookups that found a snapshot",
          "state_cache_misses": "state cache lookups that found none",
          "decisions": "requests answered with a decision",
          "input_tokens": "prompt tokens of answered decisions",
          "cached_tokens": "prompt tokens restored from the state cache instead of decoded"}
CHOICES = ("affinity: to its state's replica; least_busy: its replica was too busy; no_key: no state to "
           "route by; spread: Ray's rule; retried: sent again after its replica stopped; retry_elsewhere: "
           "that second attempt kept off the replica that stopped")

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()
_replicas: dict[str, dict[str, Any]] = {}


def count(choice: str) -> None:
    with _lock:
        _counts[choice] += 1


def counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def keep_stats(live: dict[str, dict[str, Any]]) -> None:
    """The live replicas' stats as a router heard them (replica id -> stats; {} until first reported)."""
    with _lock:
        for gone in set(_replicas) - set(live):
            del _replicas[gone]
        for rid, stats in live.items():
            if stats:
                _replicas[rid] = stats


def replica_stats() -> dict[str, dict[str, Any]]:
    with _lock:
        return {k: dict(v) for k, v in _replicas.items()}


class _Snapshot(Collector):
    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        choices, replicas = counts(), replica_stats()
        routed = CounterMetricFamily("clef_routing", f"requests routed, by the router's choice ({CHOICES})",
                                     labels=("choice",))
        for choice, n in sorted(choices.items()):
            routed.add_metric([choice], n)
        yield routed
        for name, what in SERIES.items():
            each = CounterMetricFamily(f"clef_replica_{name}", f"{what}, per replica", labels=("replica",))
            total = CounterMetricFamily(f"clef_{name}", f"{what}, every live replica summed")
            for rid, stats in sorted(replicas.items()):
                each.add_metric([rid], stats.get(name, 0))
            total.add_metric([], sum(s.get(name, 0) for s in replicas.values()))
            yield each
            yield total
        info = GaugeMetricFamily("clef_replica_info", "a live model replica; value 1", labels=("replica", "pid"))
        for rid, stats in sorted(replicas.items()):
            info.add_metric([rid, str(stats.get("pid", ""))], 1)
        yield info


_registry = CollectorRegistry()
_registry.register(_Snapshot())


def exposition() -> tuple[bytes, str]:
    """The ingress's ``/metrics`` text: routing choices, each replica's stats and their sums."""
    return generate_latest(_registry), CONTENT_TYPE_LATEST
