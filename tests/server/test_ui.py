"""The playground page's server side (clef_gguf/server/ui.py): its routes and headers, what it may
load, the key it must not need, ``serve --no-ui``, ``clef-gguf ui`` and the wheel's package data.

The page itself runs in a real browser in test_ui_browser.py.
"""

from __future__ import annotations

import fnmatch
import re
import socket
import subprocess
import sys
import threading
import tomllib
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from clef_gguf import cli
from clef_gguf.server import ui, ui_command
from clef_gguf.server.app import create_app
from server_helpers import REPO, DEADLINE_S, serve_process, wait_healthy, wait_process_ready

STATIC = REPO / "clef_gguf" / "server" / "static"


class NoModel:
    """Enough of a ``Clef`` for routes that never reach the model."""

    info = {"name": "no-model"}
    provenance = None
    models: dict = {}

    def prepare(self, *_args, **_kwargs):
        raise AssertionError("the page's routes must not touch the model")

    run = prepare

    def close(self) -> None:
        pass


def client(**kwargs) -> TestClient:
    return TestClient(create_app(NoModel(), **kwargs), raise_server_exceptions=True)


@pytest.mark.parametrize("path, media_type, name", [
    ("/", "text/html", "index.html"), ("/ui/app.js", "text/javascript", "app.js"),
    ("/ui/app.css", "text/css", "app.css"), ("/ui/icon.svg", "image/svg+xml", "icon.svg")])
def test_page_and_assets_are_served_with_a_strict_csp(path, media_type, name):
    response = client().get(path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith(media_type)
    assert response.content == (STATIC / name).read_bytes()
    csp = response.headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'"
    assert directives["script-src"] == "'self'" and directives["style-src"] == "'self'"
    assert directives["connect-src"] == "'self'" and directives["frame-ancestors"] == "'none'"
    # the pictures' thumbnails: object URLs the page makes itself; no data:, nothing from elsewhere
    assert directives["img-src"] == "'self' blob:"
    assert "unsafe" not in csp  # no inline code, no eval
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["referrer-policy"] == "no-referrer"


def js_constant(name: str) -> int:
    """``const NAME = <integer product>;`` in app.js, evaluated."""
    found = re.search(rf"^\s*const {name} = ([\d\s*_]+);", (STATIC / "app.js").read_text(), re.M)
    assert found, name
    product = 1
    for factor in found.group(1).split("*"):
        product *= int(factor)
    return product


def test_page_limits_equal_the_servers():
    # the page refuses a request with pictures over these before sending it, with the server's words
    from clef_gguf.media.sources import DEFAULT_MAX_IMAGES
    from clef_gguf.server.app import DEFAULT_MAX_BODY
    assert js_constant("MAX_BODY_BYTES") == DEFAULT_MAX_BODY
    assert js_constant("MAX_IMAGES") == DEFAULT_MAX_IMAGES


def test_page_words_its_refusals_as_the_server_does():
    from clef_gguf.core import errors
    from clef_gguf.media.sources import MediaPolicy, check_count
    with client(max_body_bytes=10) as started:  # the lifespan runs: no "shutting_down"
        refused = started.post("/v1/systemone", content=b"{}" * 10,
                               headers={"Content-Type": "application/json"})
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "body_too_large"
    with pytest.raises(errors.MediaTooLarge) as too_many:
        check_count(33, MediaPolicy(), "images")
    script = (STATIC / "app.js").read_text()
    for message in (refused.json()["error"]["message"], too_many.value.message):
        # the message's words between its numbers, each a string literal the page joins them with
        for words in filter(None, re.split(r"\d+", message)):
            assert f'"{words}' in script or f'{words}"' in script, (message, words)


def test_page_is_not_in_the_api_schema():
    paths = client().get("/openapi.json").json()["paths"]
    assert not set(paths) & ui.PATHS


class PageScan(HTMLParser):
    """Every tag with its attributes, and any text inside <script>/<style>."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.inline: list[str] = []
        self._open: str | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._open = tag

    def handle_endtag(self, tag):
        self._open = None

    def handle_data(self, data):
        if self._open in ("script", "style") and data.strip():
            self.inline.append(data)


def test_page_has_no_inline_code_and_labels_every_control():
    scan = PageScan()
    scan.feed((STATIC / "index.html").read_text())
    assert not scan.inline, "inline <script>/<style> would need 'unsafe-inline' in the CSP"
    for tag, attrs in scan.tags:
        assert tag != "style"
        assert "style" not in attrs and not any(a.startswith("on") for a in attrs), (tag, attrs)
        if tag == "script":
            assert attrs["src"].startswith("/ui/")
        if tag == "link":
            assert attrs["href"].startswith("/ui/")
    labelled = {attrs["for"] for tag, attrs in scan.tags if tag == "label"}
    for tag, attrs in scan.tags:
        if tag in ("input", "select", "textarea"):
            assert attrs["id"] in labelled or "aria-label" in attrs, f"unlabelled {tag} {attrs}"


def test_assets_load_nothing_from_elsewhere():
    # No CDN, no web fonts, no telemetry: no absolute URL, no @import or url() to fetch.
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I) or \
            path.name == "icon.svg" and "http://www.w3.org/2000/svg" in text, path
        assert "@import" not in text and "url(" not in text, path
        if path.suffix == ".js":
            # markup built from strings would defeat the textContent-only rule
            for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                         "new Function"):
                assert sink not in text, (path, sink)


def test_page_loads_without_the_api_key_but_the_api_does_not():
    c = client(api_key="s3cret")
    for path in ui.PATHS:
        assert c.get(path).status_code == 200, path
    refused = c.get("/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code != 401


def test_ui_off_serves_no_page():
    c = client(ui=False)
    for path in ui.PATHS:
        response = c.get(path)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    keyed = client(ui=False, api_key="s3cret")
    assert keyed.get("/").status_code == 401  # not an open path once the page is off


def test_serve_and_ui_flags():
    serve = cli.build_parser("serve").parse_args(["serve", "--model", "m"])
    assert serve.no_ui is False
    assert cli.build_parser("serve").parse_args(["serve", "--no-ui"]).no_ui is True
    page = cli.build_parser("ui").parse_args(["ui", "--model", "m", "--no-browser"])
    assert page.no_browser is True and page.port == 0 and page.host == "127.0.0.1"
    assert page._run is ui_command.run


def test_ui_refuses_no_ui(capsys):
    with pytest.raises(SystemExit) as info:  # the page is what `ui` serves: it has no such flag
        cli.build_parser("ui").parse_args(["ui", "--model", "m", "--no-ui"])
    assert info.value.code == 2
    assert "--no-ui" in capsys.readouterr().err


def test_serve_no_ui_process(tmp_path, tiny_model_dir):
    with serve_process(tmp_path, "--model", str(tiny_model_dir), "--threads", "1", "--no-ui") as \
            (proc, url, _port):
        wait_healthy(proc, url)
        assert httpx.get(f"{url}/", timeout=DEADLINE_S).status_code == 404
        assert httpx.get(f"{url}/v1/models", timeout=DEADLINE_S).status_code == 200


def test_ui_command_serves_the_page_on_a_free_loopback_port(tmp_path, tiny_model_dir):
    log = tmp_path / "ui.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "clef_gguf.cli", "ui", "--model",
                                 str(tiny_model_dir), "--threads", "1", "--no-browser"],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
    proc.log_path = log  # what wait_process_ready reports if it exits
    try:
        found: list[str] = []

        def announced() -> bool:
            found[:] = re.findall(r"http://127\.0\.0\.1:\d+/", log.read_text())
            return bool(found)

        wait_process_ready(proc, announced, "clef-gguf ui to print its address")
        url = found[0]

        def page() -> bool:
            try:
                return httpx.get(url, timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_process_ready(proc, page, "the page to be served")
        assert "clef-gguf" in httpx.get(url, timeout=5).text
    finally:
        proc.terminate()
        assert proc.wait(DEADLINE_S) == 0, log.read_text()


def test_browser_opens_once_the_port_listens(monkeypatch):
    opened: list[str] = []
    monkeypatch.setattr(ui_command.webbrowser, "open", lambda url: opened.append(url) or True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        thread = threading.Thread(target=ui_command._open_when_listening,
                                  args=(f"http://127.0.0.1:{port}/", "127.0.0.1", port))
        thread.start()
        thread.join(DEADLINE_S)
    assert opened == [f"http://127.0.0.1:{port}/"]


def test_static_files_ship_in_the_wheel():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "clef_gguf.server" in data["packages"]
    patterns = data["package-data"]["clef_gguf.server"]
    files = sorted(p.name for p in STATIC.iterdir())
    assert files == sorted(name for name, _ in ui.ASSETS.values())
    for name in files:
        assert any(fnmatch.fnmatch(f"static/{name}", pat) for pat in patterns), name


def test_static_files_read_from_the_package():
    for name, _ in ui.ASSETS.values():
        assert ui.asset(name) == Path(STATIC / name).read_bytes()
