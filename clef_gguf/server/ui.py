"""The decision playground: a single offline page on ``GET /`` of ``clef-gguf serve``.

The page is plain HTML/CSS/JS shipped in the wheel (``static/``): no CDN, no web fonts, no build
step, nothing fetched but this server's own API. Its routes are added to the server's app by
``add_routes``; they answer without the API key (``PATHS`` joins the server's open paths) because
the page holds no secret: it asks for the key itself and sends it on its API calls.

Every response carries a Content-Security-Policy that allows only this origin's own script and
stylesheet files (no inline code, no ``eval``, no frames, no form posts), so text that reached the
page from a request could not run even if it were ever put into the document as markup. Images: this
origin's and ``blob:`` object URLs, the thumbnails the page makes of a request's pictures.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

# url path -> (file under static/, media type)
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/evidence.js": ("evidence.js", "text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", "text/css; charset=utf-8"),
    "/ui/icon.svg": ("icon.svg", "image/svg+xml"),
}
PATHS = frozenset(ASSETS)  # served without the API key: the page asks for the key itself
# img-src blob:: the thumbnails of the request's pictures are object URLs the page makes from bytes it
# already holds (a picked, dropped or pasted file; a picture of a run in the history): nothing is
# fetched for them, and data: stays refused (the page never needs it).
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new version of the package must not meet an old script
}


def asset(name: str) -> bytes:
    """One file of the page, read from the installed package."""
    return resources.files("clef_gguf.server").joinpath("static", name).read_bytes()


def add_routes(app: Any) -> None:
    """Add ``GET /`` and the page's assets to a FastAPI ``app`` (left out of its OpenAPI
    schema: they are not part of the API)."""
    for path, (name, media_type) in ASSETS.items():
        # read once: a few tens of KB, and the installed files do not change under a server
        app.add_api_route(path, _responder(asset(name), media_type), methods=["GET"],
                          include_in_schema=False, response_model=None)


def _responder(body: bytes, media_type: str) -> Callable[[], Awaitable[Any]]:
    from starlette.responses import Response

    async def serve() -> Any:  # not ``Response``: FastAPI resolves annotations at runtime
        return Response(body, media_type=media_type, headers=HEADERS)

    return serve
