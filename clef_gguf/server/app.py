"""``clef-gguf serve``: the model behind ``POST /v1/systemone`` (the SystemOne wire format).

Endpoints: ``POST /v1/systemone`` (one request; also takes avrik-sdk's batch shape),
``POST /v1/systemone/batch``, Workers AI's run route (``server.workers_ai``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (``server.metrics``), ``GET /openapi.json``.

Flow of a request: a place in the prepare stage (429 when ``--queue-size`` requests already wait
for the tokenizer) -> read the body (size-capped) -> ``Clef.prepare`` (validate + tokenize, on one
of ``--tokenize-workers`` threads; bad requests answer 422/413 at once) -> the bounded queue (429
when full) -> ``Clef.run`` on the single worker thread -> the response. A client that disconnects
while waiting is not prepared (waiting for a tokenizer), has its job dropped (queued) or its
result discarded (already running).

Determinism: the body carries no timings and no request id, so the same request gets the same
bytes back; the id is in ``X-Request-Id`` and the timings in ``Server-Timing``.

This module builds the app (``create_app``) and runs it (the ``serve`` command); the endpoints
are ``routes``, a request's waits and their refusals ``jobs``, the wire contract ``schema``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

from clef_gguf.core.errors import ClefError, MissingField
from clef_gguf.media.sources import INLINE_ONLY, MediaPolicy
from clef_gguf.server import schema
from clef_gguf.server import ui as page
from clef_gguf.server.guard import Guard, SitePolicy, guard_rules
from clef_gguf.server.http import RequestContext, listen
from clef_gguf.server.jobs import JobRunner
from clef_gguf.server.metrics import PATH as METRICS_PATH
from clef_gguf.server.metrics import Metrics
from clef_gguf.server.settings import (DEFAULT_MAX_BATCH, DEFAULT_MAX_BODY, DEFAULT_QUEUE_SIZE,
                                       DEFAULT_TOKENIZE_WORKERS, ServerSettings)
from clef_gguf.server.state import Served, loader_for
from clef_gguf.server.workqueue import InferenceQueue, PrepareStage

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("clef_gguf.server")

# At shutdown, how long to let a background load finish: leaving the interpreter while llama.cpp
# or torch is mid-load in another thread aborts the process (seen: exit 134 on SIGTERM).
LOAD_JOIN_S = 10


def create_app(model: Any, *, api_key: str | None = None,
               queue_size: int = DEFAULT_QUEUE_SIZE, max_body_bytes: int = DEFAULT_MAX_BODY,
               max_batch: int = DEFAULT_MAX_BATCH, load_kwargs: dict[str, Any] | None = None,
               on_load_error: Callable[[ClefError], None] | None = None,
               tokenize_workers: int = DEFAULT_TOKENIZE_WORKERS, ui: bool = True,
               media_policy: MediaPolicy = INLINE_ONLY, site: SitePolicy = SitePolicy()
               ) -> FastAPI:
    """The ASGI app. ``model``: a loaded ``Clef`` or ``Models`` (served as is, not closed at
    shutdown), a model directory / catalog name (its ``Models`` loaded in the background with
    ``Clef.load(model, **load_kwargs)``'s settings), or a zero-argument callable returning either
    (also loaded in the background; ``runtime.flags.load_model`` for ``serve``).

    ``queue_size`` bounds both waits: requests waiting for one of the ``tokenize_workers``
    threads, and prepared requests waiting for the model. ``ui``: serve the playground page on
    ``GET /`` (``clef_gguf.server.ui``). ``media_policy``: where requests' images may come from
    (default: inline only, data: URIs and base64). ``site``: the Host names and page origins it
    answers to beyond the loopback names on its own port (``server.guard``). The commands build these
    keywords from their settings in one place, ``ServerSettings.app_kwargs``."""
    from fastapi import FastAPI

    from clef_gguf import __version__
    from clef_gguf.server.routes import Routes, refusal_for

    ready = hasattr(model, "prepare") and hasattr(model, "run")
    served = Served(model if ready else None,
                    None if ready else loader_for(model, load_kwargs or {}), on_load_error)
    queue = InferenceQueue(queue_size)
    stage = PrepareStage(tokenize_workers, queue_size, retry_after=queue.retry_after)
    app = FastAPI(title="clef-gguf", version=__version__, lifespan=lifespan(served, queue, stage),
                  description="Clef decision models, SystemOne wire format (/v1/systemone).",
                  docs_url=None, redoc_url=None)  # the docs UIs load scripts from a CDN
    app.state.served, app.state.queue, app.state.prepare_stage = served, queue, stage
    metrics = app.state.metrics = Metrics(served, queue, stage)
    if ui:
        page.add_routes(app)
    Routes(served, JobRunner(queue, stage), max_body_bytes=max_body_bytes,
           max_batch=max_batch, media_policy=media_policy).register(app)
    add_metrics_route(app, metrics)
    app.openapi = lambda: openapi_document(app, max_batch)  # type: ignore[method-assign]
    rules = guard_rules(api_key=api_key, ui=ui, site=site)
    # Starlette runs the middleware added last first: the request id and log line wrap the guard.
    app.add_middleware(Guard, **rules, refusal_for=refusal_for)
    app.add_middleware(RequestContext, quiet_paths=rules["open_paths"] | {METRICS_PATH},
                       observe=metrics.observe)
    return app


def add_metrics_route(app: FastAPI, metrics: Metrics) -> None:
    """``GET /metrics`` (behind the key when one is set; left out of the OpenAPI document: it is
    Prometheus' text, not the API)."""
    from starlette.responses import Response

    async def scrape() -> Any:  # not ``Response``: FastAPI resolves annotations at runtime
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    app.add_api_route(METRICS_PATH, scrape, methods=["GET"], include_in_schema=False,
                      response_model=None)


def lifespan(served: Served, queue: InferenceQueue, stage: PrepareStage
             ) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """Start the two stages (and the background load) with the server; at shutdown, after
    uvicorn drained the open requests, stop them and close what was loaded."""
    @asynccontextmanager
    async def run(_app: Any) -> AsyncIterator[None]:
        await queue.start()
        await stage.start()
        if served.clef is None:
            served.start_loading()
        try:
            yield
        finally:
            await stage.stop()
            await queue.stop()  # after uvicorn drained the open requests
            served.close()  # a load still running closes its model itself when it ends
            if served.still_loading:
                log.info("waiting up to %d s for the model load to end", LOAD_JOIN_S)
                await asyncio.get_running_loop().run_in_executor(None, served.wait_loaded,
                                                                 LOAD_JOIN_S)

    return run


def openapi_document(app: FastAPI, max_batch: int) -> dict[str, Any]:
    """``/openapi.json``: FastAPI's document of the routes (responses from the pydantic models
    of ``server.schema``), with the request bodies the routes read themselves; built once."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        document = get_openapi(title=app.title, version=app.version,
                               description=app.description, routes=app.routes)
        app.openapi_schema = schema.add_request_bodies(document, schema.REQUEST_BODIES,
                                                       max_batch)
    return app.openapi_schema


# ---------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser, **overrides: Any) -> None:
    """``clef-gguf serve`` flags: the shared model flags plus the server's own, generated from
    ``ServerSettings`` (``overrides``: a command's variations of that declaration, as ``clef-gguf ui``'s;
    ``CommandSettings.add_arguments``)."""
    from clef_gguf.runtime.flags import add_model_arguments

    add_model_arguments(p)
    ServerSettings.add_arguments(p, **overrides)


def run(args: argparse.Namespace, sock: socket.socket | None = None,
        settings: ServerSettings | None = None) -> int:
    """Serve until Ctrl-C / SIGTERM (exit 0); a model that fails to load raises its ClefError. ``sock``:
    the listening socket already bound to the settings' host and port (else bound here, before the model
    loads); ``settings``: the server's (else those the flags and the environment give)."""
    import uvicorn

    from clef_gguf.runtime.devices import check_head_device
    from clef_gguf.runtime.flags import load_model

    settings = settings or ServerSettings.from_args(args)  # a bad flag or variable: refused before anything
    app_kwargs = settings.app_kwargs()  # a --media-allow-files DIR that is no directory: refused here too
    if args.model is None and args.gguf is None:  # fail before binding, not in the background
        raise MissingField("give --model (a model directory or catalog name) or --gguf with "
                           "its head files", field="model")
    check_head_device(args.head_device)  # a head device this torch cannot give: no server at all
    # the address before the model: a taken port is an error now, not after minutes of loading
    sock = sock or listen(settings.host, settings.port)
    for name in ("clef_gguf.server", "uvicorn.error"):  # the per-request lines and startup
        logging.getLogger(name).setLevel(logging.INFO)
    if settings.engine == "ray-serve":
        from clef_gguf.server import ray_serve

        sock.close()  # Ray Serve's proxy binds it itself
        return ray_serve.run(settings.onto(args), create_app)  # the flags as the settings resolved them
    if not settings.loopback_only and not settings.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use "
                    "the model", settings.host)
    holder: dict[str, Any] = {}

    def load_failed(_error: ClefError) -> None:
        holder["server"].should_exit = True  # polled by uvicorn's main loop; thread-safe flag

    app = create_app(lambda: load_model(args), on_load_error=load_failed, **app_kwargs)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                            access_log=False,  # our own line per request replaces it
                            # uvicorn annotates it int but waits a float number of seconds
                            timeout_graceful_shutdown=settings.drain_timeout)  # type: ignore[arg-type]
    server = holder["server"] = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down; with the default
    # handlers that would turn a clean SIGTERM into "killed by signal". Record it instead.
    stopped_by: list[int] = []

    def stop(sig: int, _frame: Any) -> None:
        stopped_by.append(sig)
        server.should_exit = True  # a signal before uvicorn installs its own handlers

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    served: Served = app.state.served
    if served.error is not None:
        raise served.error
    code = 0 if server.started else 1
    log.info("stopped%s", f" ({signal.Signals(stopped_by[0]).name})" if stopped_by else "")
    if served.still_loading:
        # Stuck loading (a slow download?): leaving through interpreter shutdown would abort
        # inside the loader thread, so end the process here, as Ctrl-C during a load would.
        log.warning("the model was still loading; exiting without waiting for it")
        logging.shutdown()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m clef_gguf.server ...``: the same as ``clef-gguf serve ...``."""
    parser = argparse.ArgumentParser(prog="clef-gguf serve", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    logging.getLogger("clef_gguf.tower.llama").setLevel(logging.ERROR)
    try:
        return run(args)
    except ClefError as exc:
        print(exc, file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
