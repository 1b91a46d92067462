"""HTTP plumbing for the server: error bodies, bounded JSON bodies, request ids, access log.

Kept apart from the routes so that ``server.py`` reads as the API. The middleware is plain ASGI
(not Starlette's ``BaseHTTPMiddleware``) because that one re-wraps ``receive`` and would hide the
client's disconnect from the handlers, which need it to drop abandoned work.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import re
import socket
import time
import uuid
from collections.abc import Callable, MutableMapping
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from clef_gguf.core import errors, refusals
from clef_gguf.core.errors import ClefError
from clef_gguf.pipeline.request import parse_json

log = logging.getLogger("clef_gguf.server")

# Request ids we echo must be safe to put in a header and a log line.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
CLIENT_CLOSED = errors.ClientClosed.status  # only for our log line: nothing is sent


def free_port() -> int:
    """A loopback TCP port nobody listens on now (for a server this process starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` and listening, made before any model loads, so that a taken
    port or a foreign address is an error at once rather than after the load."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # as uvicorn binds: a port left in TIME_WAIT by a server that just stopped is free to take
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except (socket.gaierror, UnicodeError) as exc:  # before OSError, which gaierror is
        sock.close()
        raise errors.AddressUnavailable(f"{shown}: the host name does not resolve ({exc})", field="host") from None
    except OSError as exc:
        sock.close()
        why = {errno.EADDRINUSE: "is in use (another server listens there: stop it or choose another --port)",
               errno.EACCES: "needs privileges to bind (ports under 1024: choose another --port)",
               errno.EADDRNOTAVAIL: "is not an address of this machine (--host)"}.get(
                   exc.errno or 0, f"cannot be bound: {exc.strerror or exc}")
        raise errors.AddressUnavailable(f"{shown} {why}", field="port" if exc.errno != errno.EADDRNOTAVAIL
                                  else "host") from None
    sock.set_inheritable(True)
    return sock


def error_response(error: ClefError) -> Response:
    """The API's error body ``{"error": {"code", "message", "field"}}`` of a registered error
    (``clef_gguf.core.errors`` holds every code, its status and its headers)."""
    return json_response(error.to_dict(), error.status, error.headers)


def dumps(obj: Any) -> bytes:
    """Compact JSON, same object -> same bytes. No NaN: the core refuses non-finite outputs."""
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate echoed from the request (question id, legend): escape everything.
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"),
                          allow_nan=False).encode("ascii")


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status_code=status, headers=headers,
                    media_type="application/json")


async def read_json(request: Request, max_bytes: int) -> Any:
    """The body decoded with Python ``json`` (int/float kept apart, key order kept: both reach the
    prompt). Refuses bodies over ``max_bytes`` by Content-Length before reading, and again while
    reading, for chunked bodies or a lying Content-Length."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise errors.InvalidContentLength("Content-Length is not a number")
        if int(length) > max_bytes:
            raise errors.BodyTooLarge(refusals.request_size(f"the body is {int(length)} bytes; "
                                                            f"the limit is {max_bytes}"))
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise errors.BodyTooLarge(refusals.request_size(f"the body exceeds the limit of {max_bytes} bytes"))
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-body: nobody to answer, and no server fault to log
        note(request, client_gone=True)
        raise client_closed() from None
    return parse_json(b"".join(chunks))


def internal_error(exc: BaseException) -> errors.InternalError:
    """A fault of ours, not the request's: 500 naming the exception (a local server, so the
    message helps the one person who reads it more than it leaks)."""
    return errors.InternalError(f"{type(exc).__name__}: {exc}")


def client_closed() -> errors.ClientClosed:
    """What a request whose client left answers: never sent, but logged as 499."""
    return errors.ClientClosed("the client disconnected")


async def until_disconnect(request: Request) -> None:
    """Return when the client closes the connection. Only call after the body was read: then
    ``receive`` has nothing left to deliver but the disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def wait_unless_gone(request: Request, future: asyncio.Future) -> bool:
    """Wait for ``future``; False if the client disconnected first (the future is left alone)."""
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({future, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return future in done
    finally:
        watcher.cancel()


def note(request: Request, **fields: Any) -> None:
    """Facts for this request's log line (tokens, queue wait, compute time)."""
    request.scope.setdefault("state", {}).setdefault("clef_log", {}).update(fields)


class RequestClient:
    """A Starlette request as the job runner's ``Client`` (``server.jobs``)."""

    def __init__(self, request: Request) -> None:
        self.request = request

    async def disconnected(self) -> bool:
        return await self.request.is_disconnected()

    async def left_before(self, future: asyncio.Future) -> bool:
        return not await wait_unless_gone(self.request, future)

    def note(self, **facts: Any) -> None:
        note(self.request, **facts)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


class RequestContext:
    """Request id (echo ``X-Request-Id`` or make one) and one log line each; outermost, so that
    what ``server.guard`` refuses has both too.

    The id goes in the ``X-Request-Id`` header only, never in the body, so that the same request
    always gets the same bytes back.
    """

    def __init__(self, app: Any, quiet_paths: frozenset[str],
                 observe: Callable[[MutableMapping[str, Any], int, dict[str, Any], float], None]
                 | None = None) -> None:
        """``observe(scope, status, facts, seconds)``: told of each request with its log line's
        facts (``server.metrics``)."""
        self.app = app
        self._quiet = quiet_paths
        self._observe = observe

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        facts = state.setdefault("clef_log", {})
        status = {"code": 500}  # stays 500 if the app dies before sending anything

        async def send_with_id(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = dict(message)
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            code = status["code"] if not facts.get("client_gone") else CLIENT_CLOSED
            elapsed = time.perf_counter() - started
            # Health probes poll every few seconds; their lines would drown the real traffic.
            level = logging.DEBUG if scope["path"] in self._quiet else logging.INFO
            log.log(level, "%s %s %s status=%d tokens=%s queue_ms=%s compute_ms=%s "
                    "total_ms=%.1f%s", request_id, scope["method"], scope["path"], code,
                    _fmt(facts.get("tokens")), _fmt(facts.get("queue_ms")),
                    _fmt(facts.get("compute_ms")), elapsed * 1000.0,
                    f" error={facts['error']}" if facts.get("error") else "")
            if self._observe is not None:
                self._observe(scope, code, facts, elapsed)
