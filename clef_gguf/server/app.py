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

from clef_gguf.core import argtypes
from clef_gguf.core.errors import ClefError, MissingField
from clef_gguf.media.sources import INLINE_ONLY, MediaPolicy, add_file_roots_argument, served_sources
from clef_gguf.server import schema
from clef_gguf.server import ui as page
from clef_gguf.server.guard import Guard, SitePolicy, allowed_host, cors_origin
from clef_gguf.server.http import RequestContext, listen
from clef_gguf.server.jobs import JobRunner
from clef_gguf.server.metrics import PATH as METRICS_PATH
from clef_gguf.server.metrics import Metrics
from clef_gguf.server.state import Served, loader_for
from clef_gguf.server.workqueue import InferenceQueue, PrepareStage

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("clef_gguf.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_QUEUE_SIZE = 64  # waiting requests: room for 32+ busy clients; past that 429 beats
#                          letting latency grow without bound
# A full 16k-token state is ~100 KB; images come inline, base64 (4/3 of their bytes): 32 MiB holds
# a few phone photos or a batch of screenshots.
DEFAULT_MAX_BODY = 32 * 1024 * 1024
DEFAULT_MAX_BATCH = 256
# Tokenizing is CPU work next to the model's own threads: two keep a burst of small requests
# moving without taking the cores a forward pass needs.
DEFAULT_TOKENIZE_WORKERS = 2
OPEN_PATHS = frozenset({"/health"})  # liveness probes work without the key; nothing secret there
# At SIGTERM, how long open requests may take to finish: one 16k-token pass of the 9B model on a
# CPU takes minutes; cutting it short would throw that work away.
DEFAULT_DRAIN_S = 300.0
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
    answers to beyond the loopback names on its own port (``server.guard``)."""
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
    open_paths = (OPEN_PATHS | page.PATHS) if ui else OPEN_PATHS
    # Starlette runs the middleware added last first: the request id and log line wrap the guard.
    app.add_middleware(Guard, api_key=api_key, open_paths=open_paths,
                       page_paths=page.PATHS if ui else frozenset(), site=site,
                       refusal_for=refusal_for)
    app.add_middleware(RequestContext, quiet_paths=open_paths | {METRICS_PATH},
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
def add_arguments(p: argparse.ArgumentParser, *, page_flag: bool = True) -> None:
    """``clef-gguf serve`` flags: the shared model flags plus the server's own (``page_flag``: whether
    ``--no-ui`` is one; ``clef-gguf ui`` serves the page, so it has no such flag)."""
    from clef_gguf.runtime.flags import add_model_arguments

    add_model_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default=DEFAULT_HOST,
                   help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=argtypes.port, default=DEFAULT_PORT, help="port (default 8080)")
    g.add_argument("--api-key", default=os.environ.get("CLEF_GGUF_API_KEY") or None,
                   help="require the key on every endpoint but /health and the page, as "
                        "'Authorization: Bearer KEY' or 'X-API-Key: KEY' (default: "
                        "$CLEF_GGUF_API_KEY; prefer the variable, argv is visible in ps)")
    g.add_argument("--allowed-host", action="append", type=allowed_host, metavar="NAME[:PORT]|*",
                   default=None,
                   help="also answer requests whose Host header names NAME (any port) or "
                        "NAME:PORT; repeatable. Default: localhost, 127.0.0.1, [::1] and the "
                        "address a client connected to, on this server's port; others get 421 "
                        "host_not_allowed (a web page re-pointing its DNS name here cannot read "
                        "answers). * answers any Host (not advised on a desktop)")
    g.add_argument("--cors-origin", action="append", type=cors_origin, metavar="URL",
                   default=None,
                   help="let web pages on this origin (http://127.0.0.1:3000) call the API: "
                        "their CORS preflights are answered and their requests run; repeatable. "
                        "Default: none; a request from any other page's origin gets 403 "
                        "origin_not_allowed, and a browser must post application/json")
    if page_flag:
        g.add_argument("--no-ui", action="store_true",
                       help="do not serve the playground page on GET / (the API only)")
    g.add_argument("--queue-size", type=argtypes.positive_int, default=DEFAULT_QUEUE_SIZE,
                   help=f"requests that may wait for the model, and as many again for a "
                        f"tokenizer thread; more get 429 + Retry-After "
                        f"(default {DEFAULT_QUEUE_SIZE})")
    g.add_argument("--tokenize-workers", type=argtypes.positive_int, default=DEFAULT_TOKENIZE_WORKERS,
                   help=f"requests validated + tokenized at once, each in a thread of its own "
                        f"(default {DEFAULT_TOKENIZE_WORKERS})")
    g.add_argument("--drain-timeout", type=argtypes.seconds, default=DEFAULT_DRAIN_S, metavar="SECONDS",
                   help=f"at SIGTERM / Ctrl-C, how long open requests may take to finish before "
                        f"they are cut off (default {DEFAULT_DRAIN_S:g}: one 16k-token pass of "
                        f"a 9B model on a CPU)")
    g.add_argument("--max-body-bytes", type=argtypes.positive_int, default=DEFAULT_MAX_BODY,
                   help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY})")
    g.add_argument("--media-allow-url", action="append", metavar="HOST|PREFIX|*", default=None,
                   help="let requests name images by URL on this host (example.com, .example.com for "
                        "its subdomains too, host:port), under this URL prefix (https://cdn.example.com/"
                        "img/), or * for any; repeatable. Default: no fetching (data: URIs and base64 "
                        "only): a server that fetches what a request names is an SSRF hole")
    add_file_roots_argument(g, "refused (unsupported_media_source)")
    g.add_argument("--max-batch", type=argtypes.positive_int, default=DEFAULT_MAX_BATCH,
                   help=f"inputs per batch request (default {DEFAULT_MAX_BATCH})")
    g.add_argument("--engine", choices=("uvicorn", "ray-serve"), default="uvicorn",
                   help="uvicorn (default): this process; ray-serve: --replicas Ray Serve "
                        "replicas of this app, one model copy each, --threads threads each "
                        "(Ray from $RAY_ADDRESS, else a private one; pip install 'clef-gguf[ray]')")
    g.add_argument("--replicas", type=argtypes.positive_int, default=1,
                   help="with --engine ray-serve: model replicas (default 1)")


def run(args: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """Serve until Ctrl-C / SIGTERM (exit 0); a model that fails to load raises its ClefError. ``sock``:
    the listening socket already bound to ``--host``/``--port`` (else bound here, before the model loads)."""
    import uvicorn

    from clef_gguf.runtime.devices import check_head_device
    from clef_gguf.runtime.flags import load_model

    if args.model is None and args.gguf is None:  # fail before binding, not in the background
        raise MissingField("give --model (a model directory or catalog name) or --gguf with "
                           "its head files", field="model")
    check_head_device(args.head_device)  # a head device this torch cannot give: no server at all
    # the address before the model: a taken port is an error now, not after minutes of loading
    sock = sock or listen(args.host, args.port)
    for name in ("clef_gguf.server", "uvicorn.error"):  # the per-request lines and startup
        logging.getLogger(name).setLevel(logging.INFO)
    if args.engine == "ray-serve":
        from clef_gguf.server import ray_serve

        sock.close()  # Ray Serve's proxy binds it itself
        return ray_serve.run(args, create_app)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use "
                    "the model", args.host)
    holder: dict[str, Any] = {}

    def load_failed(_error: ClefError) -> None:
        holder["server"].should_exit = True  # polled by uvicorn's main loop; thread-safe flag

    app = create_app(lambda: load_model(args), api_key=args.api_key, queue_size=args.queue_size,
                     max_body_bytes=args.max_body_bytes, max_batch=args.max_batch,
                     on_load_error=load_failed, tokenize_workers=args.tokenize_workers,
                     ui=not args.no_ui, media_policy=served_sources(args),
                     site=SitePolicy.from_args(args))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                            access_log=False,  # our own line per request replaces it
                            timeout_graceful_shutdown=args.drain_timeout)
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
