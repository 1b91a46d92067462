"""``clef-gguf serve --engine ray-serve --replicas N``: the server's own FastAPI app
(``create_app``) in each of N Ray Serve replicas, one model copy per replica, behind Ray Serve's
HTTP proxy on ``--host``/``--port``.

Each replica loads the model in its constructor, so Ray Serve routes to it only once it can
answer; then the app is built on the replica (``__serve_build_asgi_app__``) around that model and
its lifespan starts the app's queues as under uvicorn. Ray Serve's health check asks the same
thing as ``GET /health``: a replica whose model is not ``ok`` is restarted. The app factory is a
parameter (``create_app`` itself, passed by ``clef_gguf.server.app`` or ``ray_app``) so that
this module does not import the server that starts it.

Ray Serve spreads requests over the replicas without regard to their state, so the state cache
hits less often than with one process; docs/batch.md gives a routing key for state affinity.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from clef_gguf.bulk.deps import need
from clef_gguf.core.cpus import available_cpus
from clef_gguf.runtime.settings import LoadSettings, for_replicas
from clef_gguf.core.children import start_ray

log = logging.getLogger("clef_gguf.server")
APP_NAME = "clef"
HEALTH_CHECK_PERIOD_S = 10
# a 9B pass on a CPU can take minutes: a health check waits behind nothing (it runs on the
# replica's event loop, not the model's thread), but a loaded machine answers slowly
HEALTH_CHECK_TIMEOUT_S = 60


class ClefReplica:
    """One Ray Serve replica: a loaded ``Clef`` and the server app around it."""

    def __init__(self, settings: LoadSettings, app_factory: Callable, app_kwargs: dict) -> None:
        from clef_gguf.runtime.model import Clef

        logging.getLogger("clef_gguf.tower.llama").setLevel(logging.ERROR)
        self.clef = Clef.from_settings(settings)
        self.app_factory, self.app_kwargs = app_factory, app_kwargs
        self._clef_app = None

    def __serve_build_asgi_app__(self) -> Any:  # the FastAPI app Ray Serve serves
        self._clef_app = self.app_factory(self.clef, **self.app_kwargs)
        return self._clef_app

    def check_health(self) -> None:
        """Ray Serve's probe, the same verdict as ``GET /health``: raising restarts the replica."""
        status = (self._clef_app.state.served.status if self._clef_app is not None
                  else "loading")
        if status != "ok":
            raise RuntimeError(f"the model is {status}")


def application(settings: LoadSettings, app_factory: Callable, app_kwargs: dict, *, replicas: int,
                threads: int, queue_size: int, drain_s: float = 300.0) -> Any:  # Ray Serve's Application
    """The Ray Serve application: bind it with ``serve.run``."""
    serve = need("ray.serve", "ray")
    ingress = serve.ingress()(ClefReplica)
    deployment = serve.deployment(
        ingress, name=APP_NAME, num_replicas=replicas, ray_actor_options={"num_cpus": threads},
        # the app queues up to queue_size itself (429 past it); Ray Serve holds as many more per
        # replica at the proxy before it answers 503
        max_ongoing_requests=queue_size, max_queued_requests=queue_size * replicas,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S, graceful_shutdown_timeout_s=drain_s)
    return deployment.bind(settings, app_factory, app_kwargs)


def run(args: argparse.Namespace, app_factory: Callable) -> int:
    """Start Ray (``$RAY_ADDRESS``, else a private one), deploy, serve until Ctrl-C / SIGTERM."""
    ray = need("ray", "ray")
    serve = need("ray.serve", "ray")
    settings = for_replicas(args, args.threads, args.replicas)
    assert settings.threads is not None  # for_replicas gives each its share
    threads = settings.threads
    from clef_gguf.media.sources import served_sources  # the serve flags' sources, as without Ray
    from clef_gguf.server.guard import SitePolicy

    app_kwargs = {"api_key": args.api_key, "queue_size": args.queue_size,
                  "max_body_bytes": args.max_body_bytes, "max_batch": args.max_batch,
                  "tokenize_workers": args.tokenize_workers, "ui": not args.no_ui,
                  "media_policy": served_sources(args), "site": SitePolicy.from_args(args)}
    address = os.environ.get("RAY_ADDRESS")
    for name in ("ray", "ray.serve"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if address:
        start_ray(ray, address=address, logging_level=logging.WARNING)
    else:
        logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)
        start_ray(ray, address="local", num_cpus=max(available_cpus(), args.replicas * threads),
                 include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = application(settings, app_factory, app_kwargs,
                          replicas=args.replicas, threads=threads, queue_size=args.queue_size,
                          drain_s=args.drain_timeout)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        log.info("Ray Serve: %d replica(s) x %d thread(s) on http://%s:%d", args.replicas,
                 threads, args.host, args.port)
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
