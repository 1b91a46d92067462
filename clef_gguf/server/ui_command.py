"""``clef-gguf ui``: ``serve`` with its page (``server/ui.py``) on a free loopback port, opened in the
default browser once the port answers. Its own module: the page is part of every server app, while
this command starts one."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
import time
import webbrowser
from typing import Any

log = logging.getLogger("clef_gguf.server")

LOOPBACK = "127.0.0.1"
OPEN_WAIT_S = 60.0  # how long `clef-gguf ui` waits for the port before giving up on the browser
# `serve`'s settings (``server.settings.ServerSettings``) as `ui` varies them: no --no-ui (the page is what
# it serves), and a free port by default (0: the system's choice, made at start)
SERVER_FLAGS: dict[str, Any] = {"omit": ("no_ui",), "defaults": {"port": 0},
                                "helps": {"port": "port (default: a free one)"}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``clef-gguf ui``: the ``serve`` flags (``SERVER_FLAGS``: a free loopback port by default, the page
    always on), and the browser."""
    from clef_gguf.server.app import add_arguments as add_serve_arguments

    add_serve_arguments(p, **SERVER_FLAGS)
    p.add_argument("--no-browser", action="store_true",
                   help="print the page's address instead of opening a browser (headless use)")


def run(args: argparse.Namespace) -> int:
    """Serve with the page on and open it in the default browser once the port answers."""
    from clef_gguf.server import app
    from clef_gguf.server.http import listen
    from clef_gguf.server.settings import ServerSettings

    settings = ServerSettings.from_args(args)
    sock = listen(settings.host, settings.port)  # port 0: the system's choice of a free one, held from now on
    settings = settings.model_copy(update={"port": int(sock.getsockname()[1])})
    host = "[::1]" if settings.host == "::1" else settings.host
    url = f"http://{LOOPBACK if host in ('0.0.0.0', '') else host}:{settings.port}/"
    print(f"clef-gguf ui: {url} (Ctrl-C stops the server)", file=sys.stderr,
          flush=True)
    if not args.no_browser:
        threading.Thread(target=_open_when_listening, args=(url, settings.host, settings.port),
                         daemon=True).start()
    return app.run(args, sock, settings)


def _open_when_listening(url: str, host: str, port: int) -> None:
    """Open ``url`` once something accepts connections on the port; the page itself waits for
    the model to finish loading."""
    end = time.monotonic() + OPEN_WAIT_S
    target = LOOPBACK if host in ("0.0.0.0", "") else host.strip("[]")
    while time.monotonic() < end:
        try:
            with socket.create_connection((target, port), timeout=1):
                break
        except OSError:
            time.sleep(0.2)
    else:
        log.warning("the server did not start listening; not opening a browser")
        return
    if not webbrowser.open(url):
        log.warning("no browser found; open %s yourself", url)
