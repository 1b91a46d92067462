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

log = logging.getLogger("clef_gguf.server")

LOOPBACK = "127.0.0.1"
OPEN_WAIT_S = 60.0  # how long `clef-gguf ui` waits for the port before giving up on the browser


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``clef-gguf ui``: the ``serve`` flags, a free loopback port by default, and the browser."""
    from clef_gguf.server.app import add_arguments as add_serve_arguments

    add_serve_arguments(p, page_flag=False)
    p.set_defaults(port=0, no_ui=False)  # 0: a free port, chosen at start; the page is on
    for action in p._actions:
        if action.dest == "port":
            action.help = "port (default: a free one)"
    p.add_argument("--no-browser", action="store_true",
                   help="print the page's address instead of opening a browser (headless use)")


def run(args: argparse.Namespace) -> int:
    """Serve with the page on and open it in the default browser once the port answers."""
    from clef_gguf.server import app
    from clef_gguf.server.http import listen

    sock = listen(args.host, args.port)  # port 0: the system's choice of a free one, held from now on
    args.port = int(sock.getsockname()[1])
    host = "[::1]" if args.host == "::1" else args.host
    url = f"http://{LOOPBACK if host in ('0.0.0.0', '') else host}:{args.port}/"
    print(f"clef-gguf ui: {url} (Ctrl-C stops the server)", file=sys.stderr,
          flush=True)
    if not args.no_browser:
        threading.Thread(target=_open_when_listening, args=(url, args.host, args.port),
                         daemon=True).start()
    return app.run(args, sock)


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
