"""``clef-gguf serve --engine ray-serve --replicas N``: the server's own app (``create_app``) in each of N
Ray Serve replicas, one model copy per replica, behind an ingress that routes each request to the replica
holding its state, on ``--host``/``--port``.

Two deployments. ``ClefReplica`` (N replicas) loads the model in its constructor, so Ray Serve routes to
it only once it can answer, and runs the app around it in its own event loop: the app's queues, limits,
refusals and bodies are ``serve``'s. Ray Serve's health check asks what ``GET /health`` says: a replica
whose model is not ``ok`` is restarted. ``ClefIngress`` is the HTTP entry behind Ray Serve's proxy: it
reads a request, computes its state key (``ray_routing.state_key``) and hands the request to a replica
through a ``DeploymentHandle``, whose router (``ray_routing.StateAffinityRouter``) chooses the replica
(Ray's proxy alone can only see headers). Decisions are pure, so a request whose replica dies before it
answers is sent once more, to another replica: the client gets the answer, not a 5xx. The ingress answers
``GET /metrics`` itself: the routers' choices and each replica's state cache, per replica and summed.

The app factory is a parameter (``create_app`` itself, passed by ``clef_gguf.server.app`` or ``ray_app``)
so that this module does not import the server that starts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
import uuid
from collections.abc import Callable
from typing import Any

from clef_gguf.core import errors
from clef_gguf.core.children import start_ray
from clef_gguf.core.cpus import available_cpus
from clef_gguf.core.deps import need
from clef_gguf.runtime.settings import LoadSettings, for_replicas
from clef_gguf.server.metrics import PATH as METRICS_PATH

log = logging.getLogger("clef_gguf.server")
APP_NAME = "clef"
MODEL, INGRESS = "model", "ingress"
HEALTH_CHECK_PERIOD_S = 10
# a 9B pass on a CPU can take minutes: a health check waits behind nothing (it runs on the
# replica's event loop, not the model's thread), but a loaded machine answers slowly
HEALTH_CHECK_TIMEOUT_S = 60
# How often each replica's stats (its state cache's hits, its decisions) reach the routers.
STATS_PERIOD_S = 1.0
# What a forwarded request keeps of the ASGI scope Ray's proxy gave the ingress: what the app reads.
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path",
              "query_string", "headers", "server", "client")
ROUTER = "clef_gguf.server.ray_routing:StateAffinityRouter"


async def call_app(app: Any, scope: dict[str, Any], body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """One HTTP request through an ASGI ``app`` in this event loop: ``(status, headers, body)``."""
    start: dict[str, Any] = {}
    chunks: list[bytes] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves: the ingress waits for the answer
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return int(start.get("status", 500)), list(start.get("headers", [])), b"".join(chunks)


class ClefReplica:
    """One model replica: a loaded ``Clef`` and the server app around it, answering forwarded requests."""

    def __init__(self, settings: LoadSettings, app_factory: Callable, app_kwargs: dict) -> None:
        from clef_gguf.runtime.model import Clef

        logging.getLogger("clef_gguf.tower.llama").setLevel(logging.ERROR)
        self.clef = Clef.from_settings(settings)
        self.app = app_factory(self.clef, **app_kwargs)
        self._lifespan: contextlib.AbstractAsyncContextManager[Any] | None = None
        self._started = asyncio.Lock()

    async def _running(self) -> None:
        """The app's lifespan (its queues), started with the first request in this replica's loop."""
        async with self._started:
            if self._lifespan is None:
                lifespan = self.app.router.lifespan_context(self.app)
                await lifespan.__aenter__()
                self._lifespan = lifespan

    async def forward(self, scope: dict[str, Any], body: bytes, **_routing: Any) -> tuple[int, list, bytes]:
        """A request the ingress forwards (its routing keywords are the router's, not the app's)."""
        await self._running()
        return await call_app(self.app, scope, body)

    def check_health(self) -> None:
        """Ray Serve's probe, the same verdict as ``GET /health``: raising restarts the replica."""
        status = self.app.state.served.status
        if status != "ok":
            raise RuntimeError(f"the model is {status}")

    def record_routing_stats(self) -> dict[str, Any]:
        """What the routers keep of this replica (``ray_routing.REPLICA_STATS``), polled by Ray Serve."""
        cache = self.clef.state_cache
        return {"pid": os.getpid(), "state_cache_hits": cache.hits, "state_cache_misses": cache.misses,
                "state_cache_bytes": cache.nbytes, **self.app.state.metrics.totals()}

    async def __del__(self) -> None:
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)


class ClefIngress:
    """The HTTP entry: each request to the replica its router chooses; ``GET /metrics`` answered here."""

    def __init__(self, model: Any, app_kwargs: dict) -> None:
        self.model = model  # the ClefReplica deployment's handle
        self.max_body_bytes = int(app_kwargs["max_body_bytes"])
        self.rules = {k: app_kwargs[k] for k in ("api_key", "site")} | {"ui": app_kwargs["ui"]}
        self._retries = 0

    def __serve_build_asgi_app__(self) -> Any:  # the Starlette app Ray Serve serves
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.routing import Route

        from clef_gguf.server.guard import Guard, guard_rules
        from clef_gguf.server.routes import refusal_for

        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
        return Starlette(routes=[Route(METRICS_PATH, self.metrics, methods=["GET"]),
                                 Route("/{path:path}", self.forward, methods=methods)],
                         middleware=[Middleware(Guard, **guard_rules(**self.rules), refusal_for=refusal_for)])

    async def forward(self, request: Any) -> Any:
        from ray import exceptions as ray_errors
        from starlette.responses import Response

        from clef_gguf.server.http import error_response
        from clef_gguf.server.ray_routing import ATTEMPT, KEY, ROUTE, state_key
        from clef_gguf.server.routed import count

        body = b""
        async for chunk in request.stream():  # the replica refuses a body over the limit (413): no more is read
            body += chunk
            if len(body) > self.max_body_bytes:
                break
        scope = {k: request.scope[k] for k in SCOPE_KEYS if k in request.scope}
        routing = {KEY: state_key(body) if request.method == "POST" else None, ROUTE: uuid.uuid4().hex}
        for attempt in (0, 1):
            try:
                status, headers, content = await self.model.forward.remote(scope, body, **routing,
                                                                            **{ATTEMPT: attempt})
                break
            except (ray_errors.RayActorError, ray_errors.ActorUnavailableError) as exc:
                if attempt:
                    return error_response(errors.ModelUnavailable(
                        f"the replicas answering this request stopped twice: {type(exc).__name__}"))
                count("retried")
                log.warning("a replica stopped while answering: sending the request to another (%s)",
                            type(exc).__name__)
        response = Response(content, status_code=status)
        response.raw_headers = [(bytes(k), bytes(v)) for k, v in headers]
        return response

    async def metrics(self, _request: Any) -> Any:
        from starlette.responses import Response

        from clef_gguf.server.routed import exposition

        body, content_type = exposition()
        return Response(body, media_type=content_type)


def application(settings: LoadSettings, app_factory: Callable, app_kwargs: dict, *, replicas: int,
                threads: int, queue_size: int, drain_s: float = 300.0, routing: str = "state",
                imbalance: int | None = None) -> Any:  # Ray Serve's Application
    """The Ray Serve application (the ingress bound to the model replicas): bind it with ``serve.run``."""
    serve = need("ray.serve", "ray")
    from clef_gguf.server.settings import DEFAULT_IMBALANCE

    router = {"request_router_class": ROUTER, "request_routing_stats_period_s": STATS_PERIOD_S,  # RequestRouterConfig
              "request_router_kwargs": {"mode": routing,
                                        "imbalance": DEFAULT_IMBALANCE if imbalance is None else imbalance}}
    model = serve.deployment(
        ClefReplica, name=MODEL, num_replicas=replicas, ray_actor_options={"num_cpus": threads},
        # the app queues up to queue_size itself (429 past it); Ray Serve holds as many more per
        # replica before it answers 503
        max_ongoing_requests=queue_size, max_queued_requests=queue_size * replicas,
        request_router_config=router, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S, graceful_shutdown_timeout_s=drain_s)
    ingress = serve.deployment(
        serve.ingress()(ClefIngress), name=INGRESS, num_replicas=1,
        ray_actor_options={"num_cpus": 0},  # it reads and forwards: the cores are the models'
        max_ongoing_requests=2 * queue_size * replicas, graceful_shutdown_timeout_s=drain_s)
    return ingress.bind(model.bind(settings, app_factory, app_kwargs), app_kwargs)


# Ray Serve gives its HTTP proxy 5 s to answer a readiness check and replaces it after three misses; while
# the replicas load, or other programs keep the cores busy, the proxy's first answer can take longer, and
# ``serve.start`` then fails. The Ray started here waits a minute instead (a value the user set wins).
PROXY_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


def run(args: argparse.Namespace, app_factory: Callable) -> int:
    """Start Ray (``$RAY_ADDRESS``, else a private one), deploy, serve until Ctrl-C / SIGTERM."""
    ray = need("ray", "ray")
    serve = need("ray.serve", "ray")
    settings = for_replicas(args, args.threads, args.replicas)
    assert settings.threads is not None  # for_replicas gives each its share
    threads = settings.threads
    from clef_gguf.server.settings import ServerSettings  # the app as `serve` builds it without Ray

    server = ServerSettings.from_args(args)
    address = os.environ.get("RAY_ADDRESS")
    for name in ("ray", "ray.serve"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if address:
        start_ray(ray, address=address, logging_level=logging.WARNING)
    else:
        logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)
        for name, value in PROXY_PATIENCE.items():  # Ray's processes inherit this environment
            os.environ.setdefault(name, value)
        start_ray(ray, address="local", num_cpus=max(available_cpus(), args.replicas * threads),
                  include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        app = application(settings, app_factory, server.app_kwargs(), replicas=server.replicas, threads=threads,
                          queue_size=server.queue_size, drain_s=server.drain_timeout, routing=server.routing,
                          imbalance=server.routing_imbalance)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        log.info("Ray Serve: %d replica(s) x %d thread(s) on http://%s:%d, routing by %s", server.replicas,
                 threads, server.host, server.port, server.routing)
        while not stop.wait(1.0):
            pass
        log.info("stopping (%s)", signal.Signals(received[0]).name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0
