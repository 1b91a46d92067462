"""``GET /metrics``: what the server did, in Prometheus' text format, written by ``prometheus-client``.

Each app has a registry of its own (tests and Ray Serve replicas build several apps in one process).
Requests are counted where their log line is written (``http.RequestContext`` calls
:meth:`Metrics.observe` with the same facts), so every request is counted once, refused ones too;
what is a level rather than a count (queue depth, loaded models) is read when scraped
(:class:`LiveState`), never kept in a second copy.

Series (all prefixed ``clef_``): ``requests_total{route,method,status}``, ``request_seconds{route}``,
``stage_seconds{stage}`` (prepare = validate + tokenize, queue = the wait for the model, then the
model's own stages: vision, tower, lexical, head, answer), ``errors_total{code}``,
``input_tokens_total``, ``cached_tokens_total``, ``decisions_total``, ``queue_depth``, ``prepare_pending``,
``model_busy``,
``model_info{name,backend,precision,default}`` and ``models_loaded``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from clef_gguf.server.state import Served
    from clef_gguf.server.workqueue import InferenceQueue, PrepareStage

PATH = "/metrics"
# Seconds: a tiny model's stage takes milliseconds, a 9B pass on a CPU minutes.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# What the model's own timings (ms, ``pipeline.answer.Decision.timings``) are called here.
STAGES = {"encode": "prepare", "vision": "vision", "tower": "tower", "lexical": "lexical",
          "head": "head", "answer": "answer"}
OTHER_ROUTE = "other"  # unmatched paths: one label, not one per path a scanner tries


class Metrics:
    """The server's counters and histograms, and the live state read at each scrape."""

    def __init__(self, served: Served, queue: InferenceQueue, stage: PrepareStage) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("clef_requests", "HTTP requests answered, by route, method and status",
                                ("route", "method", "status"), registry=r)
        self.latency = Histogram("clef_request_seconds", "time from the request's arrival to its answer",
                                 ("route",), buckets=BUCKETS, registry=r)
        self.stages = Histogram("clef_stage_seconds", "time of one decision's stages (prepare: validate "
                                "+ tokenize; queue: the wait for the model; then the model's stages)",
                                ("stage",), buckets=BUCKETS, registry=r)
        self.errors = Counter("clef_errors", "refusals and failures, by error code", ("code",), registry=r)
        self.input_tokens = Counter("clef_input_tokens", "prompt tokens of answered decisions", registry=r)
        self.cached_tokens = Counter("clef_cached_tokens", "prompt tokens restored from the state cache "
                                     "instead of decoded", registry=r)
        self.decisions = Counter("clef_decisions", "requests answered with a decision (their usage counted "
                                 "above)", registry=r)
        r.register(LiveState(served, queue, stage))

    def observe(self, scope: MutableMapping[str, Any], status: int, facts: Mapping[str, Any],
                seconds: float) -> None:
        """One request, at its log line: ``facts`` are the ones noted for that line."""
        route = scope.get("route")
        label = getattr(route, "path", None) or OTHER_ROUTE
        self.requests.labels(label, scope["method"], str(status)).inc()
        self.latency.labels(label).observe(seconds)
        if facts.get("error"):
            self.errors.labels(facts["error"]).inc()
        if facts.get("queue_ms") is not None:
            self.stages.labels("queue").observe(facts["queue_ms"] / 1000.0)
        for name, ms in (facts.get("timings") or {}).items():
            if name in STAGES and isinstance(ms, (int, float)):
                self.stages.labels(STAGES[name]).observe(ms / 1000.0)
        usage = facts.get("usage") or {}
        if usage:
            self.decisions.inc()
        self.input_tokens.inc(usage.get("input_tokens", 0))
        self.cached_tokens.inc(usage.get("cached_tokens", 0))

    def totals(self) -> dict[str, float]:
        """The decision counters' values so far (what a Ray Serve replica reports to its routers)."""
        get = self.registry.get_sample_value
        return {name: get(f"clef_{name}_total") or 0.0 for name in ("decisions", "input_tokens", "cached_tokens")}

    def exposition(self) -> tuple[bytes, str]:
        """The text a scrape reads, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class LiveState(Collector):
    """Levels read at each scrape: the queues' depths and the loaded models."""

    def __init__(self, served: Served, queue: InferenceQueue, stage: PrepareStage) -> None:
        self.served, self.queue, self.stage = served, queue, stage

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("clef_queue_depth", "prepared requests waiting for the model",
                                value=self.queue.waiting)
        yield GaugeMetricFamily("clef_prepare_pending", "requests admitted to the tokenizer stage "
                                "(reading, waiting or tokenizing)", value=self.stage.pending)
        yield GaugeMetricFamily("clef_model_busy", "1 while a forward pass runs",
                                value=int(self.queue.busy))
        info = GaugeMetricFamily("clef_model_info", "a loaded model (base or fine-tune); value 1",
                                 labels=("name", "backend", "precision", "default"))
        clef = self.served.clef
        models: Mapping[str, Any] = clef.models if clef is not None else {}
        default = clef.provenance.model_name if clef is not None and clef.provenance else None
        for name, model in sorted(models.items()):
            details = model.info
            info.add_metric([name, str(details.get("backend", "")), str(details.get("precision", "")),
                             str(name == default).lower()], 1)
        yield info
        yield GaugeMetricFamily("clef_models_loaded", "models this server answers with (0 while "
                                "loading)", value=len(models))
