"""Who may ask: the ``Host`` a request names, the page it comes from, the body type a browser sends,
and the API key. Every check runs before the request reaches a route, so a refused request costs
no tokenizer and no model time.

Why each check exists (a server on the user's desktop, next to the user's browser):

- **Host.** A page whose DNS name is re-pointed at 127.0.0.1 (DNS rebinding) is same-origin with
  itself and could read our answers; the only trace of it is the ``Host`` header, which carries the
  page's name. By default the server answers to the loopback names and the address the client
  connected to (``scope["server"]``, so ``0.0.0.0`` answers to the LAN address it was reached on),
  each on the port it listens on; ``--allowed-host`` adds names, ``*`` turns the check off.
- **Origin.** Any page may send a "simple" cross-site POST (``text/plain``, a form) without a
  preflight: it cannot read the answer, but the decision would run. A request carrying an
  ``Origin`` other than the server's own (or one named with ``--cors-origin``) is refused, and so
  is one lacking it that says ``Sec-Fetch-Site: cross-site`` (but for a top-level navigation to
  the page, which runs nothing and cannot be framed: its CSP says ``frame-ancestors 'none'``).
- **Body type.** A request from a browser (it carries ``Origin`` or ``Sec-Fetch-*``) must send its
  body as ``application/json``, which no form and no simple request can, so it always preflights.
  curl, SDKs and scripts send neither header and post as before (``curl -d`` included).
- **CORS**, off by default: preflights are answered only for the ``--cors-origin`` origins.
- **The key**: ``Authorization: Bearer KEY`` or ``X-API-Key: KEY``, compared in constant time
  (hashes of equal length), never logged.

Starlette's ``TrustedHostMiddleware`` ignores the port and its ``CORSMiddleware`` lets a simple
cross-site request run (it only withholds the answer), so neither is used: this is plain ASGI,
like ``server.http.RequestContext``, which stays outermost (request id and log line).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import re
import urllib.parse
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from clef_gguf.core import errors
from clef_gguf.core.errors import ClefError
from clef_gguf.server.http import error_response
from clef_gguf.server.ui import PATHS as PAGE_PATHS

log = logging.getLogger("clef_gguf.server")

OPEN_PATHS = frozenset({"/health"})  # liveness probes work without the key; nothing secret there
ANY = "*"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
DEFAULT_PORTS = {"http": 80, "https": 443}
BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH", b"DELETE"})
# What a preflight may ask for, and what a page on an allowed origin may read of the answer.
CORS_METHODS = "GET, POST"
CORS_HEADERS = "Authorization, Content-Type, X-API-Key, X-Request-Id"
CORS_EXPOSE = "Retry-After, Server-Timing, X-Request-Id"
CORS_MAX_AGE = "600"
REMEMBERED = 256  # hosts and origins logged once each; past this many, no more lines

# A Host header: a DNS name or IPv4 literal, or a bracketed IPv6 literal, and an optional port.
_HOST = re.compile(r"^(?P<name>\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(?::(?P<port>[0-9]{1,5}))?$")


@dataclass(frozen=True)
class SitePolicy:
    """What the server answers to beyond its defaults. ``allowed_hosts``: ``NAME`` (any port),
    ``NAME:PORT``, or ``*`` (no Host check at all); ``cors_origins``: ``scheme://host[:port]``
    origins whose pages may call the API (their preflights answered, their requests run). ``serve``'s
    ``--allowed-host`` and ``--cors-origin`` give them (``ServerSettings.site``)."""

    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    @property
    def any_host(self) -> bool:
        return ANY in self.allowed_hosts

    def host_allowed(self, name: str, port: int | None, server: tuple[str, int] | None) -> bool:
        """Whether ``name[:port]`` (a parsed Host) is one this server answers to, ``server`` being
        the address the client connected to."""
        if self.any_host:
            return True
        for entry in self.allowed_hosts:
            entry_name, _, entry_port = entry.rpartition(":") if _has_port(entry) else (entry, "", "")
            if entry_name == name and (not entry_port or int(entry_port) == (port or 80)):
                return True
        if server is None:  # no socket (an in-process client): the loopback names only
            return name in LOOPBACK_NAMES
        bound_name, bound_port = bracketed(server[0]), server[1]
        return name in (LOOPBACK_NAMES | {bound_name}) and (port or 80) == bound_port


def _has_port(entry: str) -> bool:
    match = _HOST.match(entry)
    return bool(match and match.group("port"))


def bracketed(address: str) -> str:
    """An address as a Host header names it (IPv6 literals in brackets), lower case."""
    address = address.lower()
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def parse_host(value: str) -> tuple[str, int | None] | None:
    """``(name, port)`` of a Host header, or None when it is not one."""
    match = _HOST.match(value.strip().lower())
    if match is None:
        return None
    port = match.group("port")
    if port is not None and not 0 < int(port) < 65536:
        return None
    return match.group("name"), int(port) if port is not None else None


# ---------------------------------------------------------------- flag value types
def allowed_host(text: str) -> str:
    """``--allowed-host``: ``*``, ``NAME`` or ``NAME:PORT`` (an IPv6 literal in brackets)."""
    text = text.strip().lower()
    if text == ANY or parse_host(text) is not None:
        return text
    raise argparse.ArgumentTypeError(f"expected a host name, NAME:PORT, [IPv6] or *, got {text!r}")


def cors_origin(text: str) -> str:
    """``--cors-origin``: an origin as browsers send it, ``http(s)://host[:port]``, no path."""
    parts = urllib.parse.urlsplit(text.strip())
    netloc = parts.netloc.lower()
    if parts.scheme.lower() not in DEFAULT_PORTS or parse_host(netloc) is None \
            or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(
            f"expected an origin such as http://127.0.0.1:3000 (scheme, host and port, no path), "
            f"got {text!r}")
    name, port = parse_host(netloc) or (netloc, None)
    if port == DEFAULT_PORTS[parts.scheme.lower()]:  # browsers leave the default port out
        netloc = name
    return f"{parts.scheme.lower()}://{netloc}"


# ---------------------------------------------------------------- the middleware
def guard_rules(*, api_key: str | None, ui: bool, site: SitePolicy) -> dict[str, Any]:
    """:class:`Guard`'s keywords (but ``refusal_for``) for a server with or without its page: the one
    place the open paths are decided, for the app and for a Ray Serve ingress in front of it."""
    return {"api_key": api_key, "open_paths": (OPEN_PATHS | PAGE_PATHS) if ui else OPEN_PATHS,
            "page_paths": PAGE_PATHS if ui else frozenset(), "site": site}


class Guard:
    """Plain ASGI: Host, Origin and body type, CORS preflights, then the key (see the module)."""

    def __init__(self, app: Any, *, api_key: str | None, open_paths: frozenset[str],
                 page_paths: frozenset[str] = frozenset(), site: SitePolicy = SitePolicy(),
                 refusal_for: Callable[[str], Callable[[ClefError], Any]] = lambda _path: error_response
                 ) -> None:
        """``refusal_for(path)``: how a refusal of a request to ``path`` is written (Workers AI's
        routes answer in their envelope)."""
        self.app = app
        self.refusal_for = refusal_for
        self._key = _digest(api_key.encode()) if api_key else None
        self._open, self._page, self.site = open_paths, page_paths, site
        self._cors = frozenset(site.cors_origins)
        self._logged: set[str] = set()
        if site.any_host:
            log.warning("--allowed-host '*': any Host is answered; a web page that re-points its "
                        "name at this machine (DNS rebinding) can read the answers")

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":  # no route takes one; refused, so none is ever open to all
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers") or [])
        origin = _one(headers, b"origin")
        origin = origin.strip().lower() if origin is not None else None  # browsers send it so
        refuse = self.refusal_for(scope["path"])
        refusal = self.refusal(scope, headers, origin)
        if refusal is None and scope["method"] == "OPTIONS" and origin is not None \
                and _one(headers, b"access-control-request-method") is not None:
            if origin in self._cors:
                await self.preflight(origin)(scope, receive, send)
                return
            refusal = self._refuse_origin(origin, f"CORS is not allowed for {origin!r}; start the "
                                          f"server with --cors-origin {origin} to allow it")
        if origin is not None and origin in self._cors:
            # an allowed page reads what it is answered, refusals (401, 415) included
            send = _with_cors(send, origin)
        if refusal is None and self._key is not None and scope["path"] not in self._open \
                and not self.authorized(headers):
            refusal = errors.Unauthorized(
                "missing or wrong API key; send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")
        if refusal is not None:
            # named in the request's log line and in /metrics' errors by code
            scope.setdefault("state", {}).setdefault("clef_log", {})["error"] = refusal.code
            await refuse(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: MutableMapping[str, Any], headers: list[tuple[bytes, bytes]],
                origin: str | None) -> ClefError | None:
        """Why this request may not run, or None."""
        hosts = [value for name, value in headers if name == b"host"]
        if len(hosts) != 1:
            return self._refuse_host(f"{len(hosts)} Host headers", "a request must name exactly "
                                     f"one Host; it named {len(hosts)}")
        host_text = hosts[0].decode("latin-1")
        parsed = parse_host(host_text)
        server = scope.get("server")
        if parsed is None or not self.site.host_allowed(*parsed, tuple(server) if server else None):
            return self._refuse_host(host_text, f"this server does not answer to Host "
                                     f"{host_text!r}; start it with --allowed-host NAME to add one")
        fetch_site = _one(headers, b"sec-fetch-site")
        if origin is not None:
            if not self.origin_allowed(origin, host_text):
                return self._refuse_origin(origin, f"requests from pages on {origin!r} are not "
                                           f"allowed; start the server with --cors-origin "
                                           f"{origin} to allow them")
        elif fetch_site == "cross-site" and not self._navigation(scope, headers):
            return self._refuse_origin("cross-site", "cross-site requests from a browser are not "
                                       "allowed (Sec-Fetch-Site: cross-site)")
        browser = origin is not None or any(name.startswith(b"sec-fetch-") for name, _ in headers)
        if browser and scope["method"].encode() in BODY_METHODS:
            media_type = (_one(headers, b"content-type") or "").split(";")[0].strip().lower()
            if media_type != "application/json":
                return errors.UnsupportedMediaType(
                    f"a browser must send the body as application/json (got "
                    f"{media_type or 'no Content-Type'!r})", field="Content-Type")
        return None

    def origin_allowed(self, origin: str, host: str) -> bool:
        """The server's own origin (the Host the request names, as either scheme), or a
        ``--cors-origin``."""
        if origin in self._cors:
            return True
        scheme, _, authority = origin.partition("://")
        return scheme in DEFAULT_PORTS and authority == host.strip().lower()

    def _navigation(self, scope: MutableMapping[str, Any],
                    headers: list[tuple[bytes, bytes]]) -> bool:
        """A top-level navigation to the page (a link from another site): it runs nothing."""
        return scope["method"] in ("GET", "HEAD") and scope["path"] in self._page \
            and _one(headers, b"sec-fetch-mode") == "navigate"

    def preflight(self, origin: str) -> Any:
        """The answer to a ``--cors-origin``'s CORS preflight."""
        from starlette.responses import Response

        return Response(status_code=204, headers={
            "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Allow-Headers": CORS_HEADERS, "Access-Control-Max-Age": CORS_MAX_AGE,
            "Vary": "Origin"})

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        scheme, _, token = (_one(headers, b"authorization") or "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else (_one(headers, b"x-api-key") or "")
        # compare_digest of two digests: neither the key nor its length leaks through timing.
        return hmac.compare_digest(_digest(given.strip().encode("latin-1")), self._key or b"")

    def _refuse_host(self, host: str, message: str) -> ClefError:
        self._log_once(f"host {host}", "refused requests naming Host %r (logged once)", host)
        return errors.HostNotAllowed(message, field="Host")

    def _refuse_origin(self, origin: str, message: str) -> ClefError:
        self._log_once(f"origin {origin}", "refused requests from %s (logged once)", origin)
        return errors.OriginNotAllowed(message, field="Origin")

    def _log_once(self, key: str, message: str, value: str) -> None:
        if key not in self._logged and len(self._logged) < REMEMBERED:
            self._logged.add(key)
            log.warning(message, value)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _one(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header ``name`` (lower case), decoded as HTTP does."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def _with_cors(send: Any, origin: str) -> Any:
    """``send`` adding what lets a page on an allowed origin read the answer."""
    extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
             (b"access-control-expose-headers", CORS_EXPOSE.encode())]

    async def wrapped(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = dict(message)
            message["headers"] = [*message.get("headers", []), *extra]
        await send(message)

    return wrapped
