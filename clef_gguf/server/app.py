"""``clef-gguf serve``: the model behind ``POST /v1/systemone`` (the SystemOne wire format).

Endpoints: ``POST /v1/systemone`` (one request; also takes avrik-sdk's batch shape),
``POST /v1/systemone/batch``, ``GET /v1/models``, ``GET /health``, ``GET /openapi.json``.

Flow of a request: a place in the prepare stage (429 when ``--queue-size`` requests already wait
for the tokenizer) -> read the body (size-capped) -> ``Clef.prepare`` (validate + tokenize, on one
of ``--tokenize-workers`` threads; bad requests answer 422/413 at once) -> the bounded queue (429
when full) -> ``Clef.run`` on the single worker thread -> the response. A client that disconnects
while waiting is not prepared (waiting for a tokenizer), has its job dropped (queued) or its
result discarded (already running).

Determinism: the body carries no timings and no request id, so the same request gets the same
bytes back; the id is in ``X-Request-Id`` and the timings in ``Server-Timing``.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route signatures at runtime,
# and ``Request`` is imported inside ``create_app`` (fastapi loads only when a server starts).
import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from clef_gguf.server import schema
from clef_gguf.errors import ClefError, MissingField
from clef_gguf.server.batch import (batch_response, compute_items, is_batch, parse_batch,
                                    prepare_items)
from clef_gguf.server.http import (ApiError, RequestContext, client_closed, internal_error,
                                   json_response, note, read_json, wait_unless_gone)
from clef_gguf.server.state import LOADING_RETRY_AFTER, Served, loader_for
from clef_gguf.server.workqueue import (Admission, ClientGone, InferenceQueue, Job,
                                        PrepareStage, QueueFull, ShuttingDown)

log = logging.getLogger("clef_gguf.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_QUEUE_SIZE = 64  # waiting requests: room for 32+ busy clients; past that 429 beats
#                          letting latency grow without bound
DEFAULT_MAX_BODY = 8 * 1024 * 1024  # a full 16k-token state is ~100 KB; batches need more
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
               max_batch: int = DEFAULT_MAX_BATCH, load_kwargs: dict | None = None,
               on_load_error: Callable[[ClefError], None] | None = None,
               tokenize_workers: int = DEFAULT_TOKENIZE_WORKERS):
    """The ASGI app. ``model``: a loaded ``Clef`` (served as is, not closed at shutdown), a model
    directory / catalog name (loaded in the background with ``Clef.load(model, **load_kwargs)``),
    or a zero-argument callable returning a ``Clef`` (also loaded in the background).

    ``queue_size`` bounds both waits: requests waiting for one of the ``tokenize_workers``
    threads, and prepared requests waiting for the model."""
    from fastapi import FastAPI, Query, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    ready = hasattr(model, "prepare") and hasattr(model, "run")
    served = Served(model if ready else None,
                    None if ready else loader_for(model, load_kwargs or {}), on_load_error)
    queue = InferenceQueue(queue_size)
    stage = PrepareStage(tokenize_workers, queue_size, retry_after=queue.retry_after)

    @asynccontextmanager
    async def lifespan(_app):
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

    from clef_gguf import __version__

    app = FastAPI(title="clef-gguf", version=__version__, lifespan=lifespan,
                  description="Clef decision models, SystemOne wire format (/v1/systemone).",
                  docs_url=None, redoc_url=None)  # the docs UIs load scripts from a CDN
    app.state.served, app.state.queue, app.state.prepare_stage = served, queue, stage

    async def run_job(request: Request, fn: Callable[[Job], Any],
                      decision: tuple[Any, Any] | None = None) -> Any:
        """Queue ``fn`` on the worker and wait; None if the client left (job dropped).
        ``decision=(clef, prepared)``: ``fn`` is ``clef.run(prepared)``, which the queue may pack
        with the decisions waiting behind it (several prompts per llama_decode, same answers)."""
        try:
            job = queue.submit(fn, decision=decision)
        except QueueFull as exc:
            raise _busy(f"{queue.maxsize} requests are already waiting for the model",
                        exc.retry_after) from None
        except ShuttingDown:
            raise _shutting_down() from None
        try:
            answered = await wait_unless_gone(request, job.future)
        except asyncio.CancelledError:  # uvicorn gave up on this request: never leave it queued
            job.abandon()
            raise
        note(request, queue_ms=job.wait_ms, compute_ms=job.compute_ms)
        if not answered:
            job.abandon()
            note(request, client_gone=True)
            return None
        try:
            return job.future.result()
        except ShuttingDown:
            raise _shutting_down() from None
        except ClefError as exc:  # InferenceError (llama_decode failed) included: a 5xx body
            log.error("inference failed: %s", exc)
            raise ApiError.from_clef(exc) from None
        except Exception as exc:
            log.exception("inference failed")
            raise internal_error(exc) from None

    async def prepare(request: Request, admission: Admission, fn: Callable, *args: Any) -> Any:
        try:
            return await stage.run(admission, fn, *args, gone=request.is_disconnected)
        except ClientGone:
            note(request, client_gone=True)
            raise client_closed() from None
        except ClefError as exc:
            raise ApiError.from_clef(exc) from None

    async def single(request: Request, clef: Any, body: Any, admission: Admission):
        prepared = await prepare(request, admission, clef.prepare, body)
        note(request, tokens=getattr(getattr(prepared, "encoded", None), "n_tokens", None))
        result = await run_job(request, lambda _job: clef.run(prepared), (clef, prepared))
        if result is None:
            return client_closed().response()
        response, timings = result
        if response.get("model") is None:  # SystemOne clients may omit it; name what answered
            response["model"] = clef.info.get("name")
        timing = ", ".join(f"{k};dur={v}" for k, v in timings.items() if k != "tokens")
        return json_response(response, headers={"Server-Timing": timing})

    async def batch(request: Request, clef: Any, body: Any, admission: Admission):
        items, model = parse_batch(body, max_batch)
        await prepare(request, admission, prepare_items, clef, items)
        note(request, tokens=sum(getattr(getattr(i.prepared, "encoded", None), "n_tokens", 0)
                                 for i in items if i.prepared is not None))
        # All refused: answered without queueing.
        if any(i.prepared is not None for i in items) and await run_job(
                request, lambda job: compute_items(clef, items, job)) is None:
            return client_closed().response()
        return json_response(batch_response(items, model or clef.info.get("name"), clef))

    async def guarded(request: Request, handler: Callable) -> Any:
        """Every refusal becomes the API's error body (and is named in the log line)."""
        admission = None
        try:
            clef = served.require()
            try:
                admission = stage.admit()
            except QueueFull as exc:  # unread: uvicorn discards the rest of the body itself
                raise _busy(f"{stage.max_waiting} requests are already waiting to be tokenized",
                            exc.retry_after) from None
            except ShuttingDown:
                raise _shutting_down() from None
            body = await read_json(request, max_body_bytes)
            return await handler(request, clef, body, admission)
        except ApiError as exc:
            note(request, error=exc.code)
            return exc.response()
        except asyncio.CancelledError:
            # uvicorn cancels requests only when --drain-timeout ran out at shutdown: answer in
            # the API's shape (it would send a bare-text 500) and let the task end normally.
            asyncio.current_task().uncancel()
            note(request, error="shutting_down")
            return ApiError(503, "shutting_down", "the server stopped before this request was "
                            "answered (--drain-timeout ran out)").response()
        except Exception as exc:  # a bug: still the API's body, the request id and a log line
            log.exception("request failed")
            note(request, error="internal_error")
            return internal_error(exc).response()
        finally:
            if admission is not None:
                admission.release()  # refused before or while preparing

    posted = schema.errors(400, 401, 413, 422, 429, 500, 503)

    @app.post("/v1/systemone", openapi_extra=schema.body(schema.single_or_batch(max_batch)),
              responses={200: schema.json_content(schema.ANSWER_OR_BATCH, "the answers (a "
                                                  "batch's results for a batch body)",
                                                  schema.REQUEST_ID), **posted})
    async def systemone(request: Request, batch_mode: bool | None = Query(
            None, alias="batch", description="force (true) or forbid (false) reading the body "
            "as a batch; by default avrik-sdk's batch shape (state: [{id, text}, ...]) and "
            "{requests: [...]} are batches")):
        async def route(request: Request, clef: Any, body: Any, admission: Admission):
            if batch_mode if batch_mode is not None else is_batch(body):
                return await batch(request, clef, body, admission)
            return await single(request, clef, body, admission)

        return await guarded(request, route)

    @app.post("/v1/systemone/batch", openapi_extra=schema.body(schema.batch_request(max_batch)),
              responses={200: schema.json_content(schema.BATCH_RESPONSE, "results in input "
                                                  "order; a refused input carries its error",
                                                  schema.REQUEST_ID), **posted})
    async def systemone_batch(request: Request):
        return await guarded(request, batch)

    @app.get("/v1/models", responses={200: schema.json_content(schema.MODELS, "the served model"),
                                      **schema.errors(401, 503)})
    async def models():
        try:
            info = dict(served.require().info)
        except ApiError as exc:
            return exc.response()
        return json_response({"models": [{"name": info.pop("name"), **info}]})

    @app.get("/health", responses={200: schema.json_content(schema.HEALTH, "ready"),
                                   503: schema.json_content(schema.HEALTH, "loading or failed")})
    async def health():
        status = served.status
        if status == "ok":
            info = served.clef.info
            return json_response({"status": "ok", "model": info.get("name"),
                                  "model_hash": _tower_hash(served.clef),
                                  "backend": info.get("backend"),
                                  "precision": info.get("precision")})
        if status == "loading":
            return json_response({"status": "loading"}, 503, {"Retry-After": LOADING_RETRY_AFTER})
        return json_response({"status": "error", "error": ApiError.from_clef(served.error).body()
                              ["error"]}, 503)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code,
                                                                 f"http_{exc.status_code}")
        return ApiError(exc.status_code, code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(RequestValidationError)
    async def query_error(_request, exc: RequestValidationError):
        first = exc.errors()[0]
        return ApiError(422, "invalid_value", first.get("msg", "invalid parameter"),
                        ".".join(str(p) for p in first.get("loc", ()))).response()

    @app.exception_handler(Exception)
    async def unhandled(_request, exc: Exception):
        log.error("unhandled error", exc_info=exc)
        return internal_error(exc).response()

    app.add_middleware(RequestContext, api_key=api_key, open_paths=OPEN_PATHS)
    return app


def _shutting_down() -> ApiError:
    return ApiError(503, "shutting_down", "the server is shutting down",
                    headers={"Retry-After": "1"})


def _busy(why: str, retry_after: int) -> ApiError:
    return ApiError(429, "queue_full", f"{why}; retry later",
                    headers={"Retry-After": str(retry_after)})


def _tower_hash(clef: Any) -> str | None:
    provenance = getattr(clef, "provenance", None)
    return getattr(provenance, "model_hash", None)


# ---------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    """``clef-gguf serve`` flags: the shared model flags plus the server's own."""
    from clef_gguf.cli_options import add_model_arguments

    add_model_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default=DEFAULT_HOST,
                   help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default 8080)")
    g.add_argument("--api-key", default=os.environ.get("CLEF_GGUF_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $CLEF_GGUF_API_KEY; prefer the variable, argv is visible in ps)")
    g.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE_SIZE,
                   help=f"requests that may wait for the model, and as many again for a "
                        f"tokenizer thread; more get 429 + Retry-After "
                        f"(default {DEFAULT_QUEUE_SIZE})")
    g.add_argument("--tokenize-workers", type=int, default=DEFAULT_TOKENIZE_WORKERS,
                   help=f"requests validated + tokenized at once, each in a thread of its own "
                        f"(default {DEFAULT_TOKENIZE_WORKERS})")
    g.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_S, metavar="SECONDS",
                   help=f"at SIGTERM / Ctrl-C, how long open requests may take to finish before "
                        f"they are cut off (default {DEFAULT_DRAIN_S:g}: one 16k-token pass of "
                        f"a 9B model on a CPU)")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                   help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY})")
    g.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help=f"inputs per batch request (default {DEFAULT_MAX_BATCH})")
    g.add_argument("--engine", choices=("uvicorn", "ray-serve"), default="uvicorn",
                   help="uvicorn (default): this process; ray-serve: --replicas Ray Serve "
                        "replicas of this app, one model copy each, --threads threads each "
                        "(Ray from $RAY_ADDRESS, else a private one; pip install 'clef-gguf[ray]')")
    g.add_argument("--replicas", type=int, default=1,
                   help="with --engine ray-serve: model replicas (default 1)")


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C / SIGTERM (exit 0); a model that fails to load raises its ClefError."""
    import uvicorn

    from clef_gguf.cli_options import load_model

    if args.model is None and args.gguf is None:  # fail before binding, not in the background
        raise MissingField("give --model (a model directory or catalog name) or --gguf with "
                           "its head files", field="model")
    for name in ("clef_gguf.server", "uvicorn.error"):  # the per-request lines and startup
        logging.getLogger(name).setLevel(logging.INFO)
    if min(args.queue_size, args.max_body_bytes, args.max_batch, args.tokenize_workers) < 1:
        print("clef-gguf serve: --queue-size, --max-body-bytes, --max-batch and "
              "--tokenize-workers must be >= 1", file=sys.stderr)
        return 2
    if not args.drain_timeout >= 0:  # also refuses nan
        print("clef-gguf serve: --drain-timeout must be >= 0 seconds", file=sys.stderr)
        return 2
    if args.engine == "ray-serve":
        from clef_gguf.bulk import serve_ray

        return serve_ray.run(args, create_app)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use "
                    "the model", args.host)
    holder: dict[str, Any] = {}

    def load_failed(_error: ClefError) -> None:
        holder["server"].should_exit = True  # polled by uvicorn's main loop; thread-safe flag

    app = create_app(lambda: load_model(args), api_key=args.api_key, queue_size=args.queue_size,
                     max_body_bytes=args.max_body_bytes, max_batch=args.max_batch,
                     on_load_error=load_failed, tokenize_workers=args.tokenize_workers)
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
        server.run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind the port
        return int(exc.code or 1)
    finally:
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
    logging.getLogger("clef_gguf.llama").setLevel(logging.ERROR)
    try:
        return run(args)
    except ClefError as exc:
        print(exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
