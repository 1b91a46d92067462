"""The API's routes: ``POST /v1/systemone`` (one request, or a batch), ``POST
/v1/systemone/batch``, ``GET /v1/models``, ``GET /health``, and the error bodies of everything the
framework refuses itself (404, 405, a bad query parameter, an unhandled exception).

Each route is a method of :class:`Routes`, which holds what they share (the served model, the job
runner, the body limits); ``register`` puts them on an app with their OpenAPI documentation
(``server.schema``). The waits and their refusals are the runner's (``server.jobs``).
"""

# No ``from __future__ import annotations``: FastAPI reads the route signatures at runtime.
import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from clef_gguf.core import errors
from clef_gguf.media.sources import INLINE_ONLY, MediaPolicy
from clef_gguf.runtime.registry import model_entries
from clef_gguf.server import schema, workers_ai
from clef_gguf.server.batch import batch_response, compute_items, is_batch, parse_batch, prepare_items
from clef_gguf.server.http import (RequestClient, client_closed, error_response, internal_error,
                                   json_response, note, read_json)
from clef_gguf.server.jobs import JobRunner
from clef_gguf.server.state import LOADING_RETRY_AFTER, Served, ServedModel
from clef_gguf.server.workqueue import Admission

log = logging.getLogger("clef_gguf.server")

POSTED = schema.refusals(400, 401, 403, 413, 415, 421, 422, 429, 500, 503)
HTTP_CODES: dict[int, type[errors.ClefError]] = {404: errors.NotFound,
                                                 405: errors.MethodNotAllowed}


@dataclass(frozen=True)
class Reply:
    """What a route answers, before the wire format wraps it."""

    body: Any
    headers: dict[str, str] | None = None


@dataclass(frozen=True)
class Wire:
    """How answers and refusals are written: SystemOne's bodies, or Workers AI's envelope."""

    answer: Callable[[Any, dict[str, str] | None], Response]
    refuse: Callable[[errors.ClefError], Response]


SYSTEMONE = Wire(lambda body, headers: json_response(body, headers=headers), error_response)
WORKERS_AI = Wire(workers_ai.answer, workers_ai.refuse)
Handler = Callable[[Request, Any, Any, Admission], Awaitable[Reply]]


def refusal_for(path: str) -> Callable[[errors.ClefError], Response]:
    """The error body a refusal of a request to ``path`` takes (the guard's and the framework's)."""
    return WORKERS_AI.refuse if workers_ai.is_run_path(path) else SYSTEMONE.refuse


class Routes:
    """The endpoints of one served model."""

    def __init__(self, served: Served, runner: JobRunner, *, max_body_bytes: int,
                 max_batch: int, media_policy: MediaPolicy = INLINE_ONLY) -> None:
        self.served, self.runner = served, runner
        self.max_body_bytes, self.max_batch = max_body_bytes, max_batch
        # Where requests' images may come from: inline (data: URIs, base64) unless the server was
        # started with an allow-list (a server that reads what a request names is an SSRF hole).
        self.media_policy = media_policy

    # ------------------------------------------------------------------ the two ways to answer
    async def single(self, request: Request, clef: ServedModel, body: Any,
                     admission: Admission) -> Reply:
        client = RequestClient(request)
        prepare = functools.partial(clef.prepare, media_policy=self.media_policy)
        prepared = await self.runner.prepare(client, admission, prepare, body)
        note(request, tokens=prepared.encoded.n_tokens)
        result = await self.runner.compute(client, lambda _job: clef.run(prepared),
                                           (clef, prepared))
        if result is None:
            raise client_closed()
        response, timings = result
        if response.get("model") is None:  # SystemOne clients may omit it; name what answered
            response["model"] = clef.info.get("name")
        timing = ", ".join(f"{k};dur={v}" for k, v in timings.items() if k != "tokens")
        note(request, timings=timings, usage=response.get("usage"))
        return Reply(response, {"Server-Timing": timing})

    async def batch(self, request: Request, clef: ServedModel, body: Any,
                    admission: Admission) -> Reply:
        client = RequestClient(request)
        items, model = parse_batch(body, self.max_batch)
        note(request, tokens=await self.runner.prepare(client, admission, prepare_items, clef,
                                                       items, self.media_policy))
        # All refused: answered without queueing.
        if any(i.prepared is not None for i in items) and await self.runner.compute(
                client, lambda job: compute_items(clef, items, job)) is None:
            raise client_closed()
        response = batch_response(items, model or clef.info.get("name"), clef)
        note(request, usage=response.get("usage"))
        return Reply(response)

    async def guarded(self, request: Request, handler: Handler, wire: Wire = SYSTEMONE) -> Response:
        """The handler's reply in ``wire``'s shape; every refusal becomes its error body (and is
        named in the log line)."""
        admission = None
        error_response = wire.refuse
        try:
            clef = self.served.require()
            admission = self.runner.admit()
            body = await read_json(request, self.max_body_bytes)
            reply = await handler(request, clef, body, admission)
            return wire.answer(reply.body, reply.headers)
        except errors.ClefError as exc:
            note(request, error=exc.code)
            return error_response(exc)
        except asyncio.CancelledError:
            # uvicorn cancels requests only when --drain-timeout ran out at shutdown: answer in
            # the API's shape (it would send a bare-text 500) and let the task end normally.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            note(request, error=errors.ServerShuttingDown.code)
            return error_response(errors.ServerShuttingDown(
                "the server stopped before this request was answered (--drain-timeout ran "
                "out)", retry_after=None))
        except Exception as exc:  # a bug: still the API's body, the request id and a log line
            log.exception("request failed")
            note(request, error=errors.InternalError.code)
            return error_response(internal_error(exc))
        finally:
            if admission is not None:
                admission.release()  # refused before or while preparing

    # ------------------------------------------------------------------ endpoints
    async def systemone(self, request: Request, batch_mode: Annotated[bool | None, Query(
            alias="batch", description="force (true) or forbid (false) reading the body as a "
            "batch; by default avrik-sdk's batch shape (state: [{id, text}, ...]) and "
            "{requests: [...]} are batches")] = None) -> Response:
        async def route(request: Request, clef: Any, body: Any, admission: Admission) -> Reply:
            if batch_mode if batch_mode is not None else is_batch(body):
                return await self.batch(request, clef, body, admission)
            return await self.single(request, clef, body, admission)

        return await self.guarded(request, route)

    async def systemone_batch(self, request: Request) -> Response:
        return await self.guarded(request, self.batch)

    async def workers_ai_run(self, request: Request, account_id: str, model: str) -> Response:
        """Workers AI's run endpoint (``server.workers_ai``): one SystemOne request in its
        envelope; ``account_id`` is accepted and ignored."""
        async def route(request: Request, clef: Any, body: Any, admission: Admission) -> Reply:
            return await self.single(request, clef,
                                     workers_ai.systemone_body(body, model, clef.models), admission)

        del account_id
        return await self.guarded(request, route, WORKERS_AI)

    async def models(self) -> Response:
        try:
            served = self.served.require()
        except errors.ClefError as exc:
            return error_response(exc)
        default = served.provenance.model_name if served.provenance is not None else None
        return json_response({"models": model_entries(served.models, default), "limits": {
            "max_body_bytes": self.max_body_bytes, "max_images": self.media_policy.max_images}})

    async def health(self) -> Response:
        status = self.served.status
        clef = self.served.clef
        if status == "ok" and clef is not None:
            info = clef.info
            provenance = clef.provenance
            return json_response({"status": "ok", "model": info.get("name"),
                                  "model_hash": provenance.model_hash if provenance else None,
                                  "backend": info.get("backend"),
                                  "precision": info.get("precision"),
                                  "gpu_layers": info.get("gpu_layers"), "head_device": info.get("head_device")})
        if status == "loading":
            return json_response({"status": "loading"}, 503, {"Retry-After": LOADING_RETRY_AFTER})
        error = self.served.error or errors.ModelLoadError("the model failed to load")
        return json_response({"status": "error", "error": error.to_dict()["error"]}, 503)

    # ------------------------------------------------------------------ on an app
    def register(self, app: FastAPI) -> None:
        """The routes with their OpenAPI documentation, and the API's error bodies for what the
        framework refuses itself."""
        app.add_api_route(
            "/v1/systemone", self.systemone, methods=["POST"],
            responses={200: schema.answer(schema.SystemOneResponse | schema.BatchResponse,
                                          "the answers (a batch's results for a batch body)"),
                       **POSTED})
        app.add_api_route(
            "/v1/systemone/batch", self.systemone_batch, methods=["POST"],
            responses={200: schema.answer(schema.BatchResponse, "results in input order; a "
                                          "refused input carries its error"), **POSTED})
        run_path, *other_run_paths = workers_ai.PATHS
        app.add_api_route(
            run_path, self.workers_ai_run, methods=["POST"], summary="Workers AI: run Clef",
            description="Cloudflare Workers AI's run endpoint: the model's path is "
                        "@cf/cloudflare/clef-flash, @cf/cloudflare/clef or a served model's name; "
                        "the same path without /client/v4 is answered too.",
            responses={200: schema.answer(schema.WorkersAiAnswer, "the SystemOne response in "
                                          "Workers AI's envelope"),
                       **schema.refusals(400, 401, 403, 404, 413, 415, 421, 422, 429, 500, 503,
                                         body=schema.WorkersAiRefusal)})
        for path in other_run_paths:
            app.add_api_route(path, self.workers_ai_run, methods=["POST"], include_in_schema=False)
        app.add_api_route("/v1/models", self.models, methods=["GET"],
                          responses={200: schema.answer(schema.ModelList, "the served model"),
                                     **schema.refusals(401, 403, 421, 503)})
        app.add_api_route(
            "/health", self.health, methods=["GET"],
            responses={200: schema.answer(schema.HealthOk, "ready"),
                       503: schema.answer(schema.HealthLoading | schema.HealthFailed,
                                          "loading or failed")})
        app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
        app.add_exception_handler(RequestValidationError, query_error)  # type: ignore[arg-type]
        app.add_exception_handler(Exception, unhandled)


async def http_error(request: Request, exc: HTTPException) -> Response:
    """404, 405 and whatever else Starlette refuses, in the API's error body."""
    kind = HTTP_CODES.get(exc.status_code)
    headers = dict(exc.headers or {})  # 405's Allow
    error = kind(str(exc.detail), headers=headers) if kind \
        else errors.HttpRefusal(exc.status_code, str(exc.detail), headers=headers)
    note(request, error=error.code)
    return refusal_for(request.url.path)(error)


async def query_error(_request: Request, exc: RequestValidationError) -> Response:
    first = exc.errors()[0]
    return error_response(errors.InvalidValue(first.get("msg", "invalid parameter"), field=".".join(
        str(p) for p in first.get("loc", ()))))


async def unhandled(_request: Request, exc: Exception) -> Response:
    log.error("unhandled error", exc_info=exc)
    return error_response(internal_error(exc))
