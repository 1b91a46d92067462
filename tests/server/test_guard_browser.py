"""``server.guard`` against a real browser: Debian's headless Chromium (``browser_helpers``) on a page
of another origin, and on a DNS-rebound name, calling an in-process uvicorn server whose model's
forward pass is counted (``Gated``). No decision may run and the page may read nothing.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from selenium.webdriver.support.ui import WebDriverWait

from browser_helpers import chromium, system_browser
from clef_gguf.server.guard import SitePolicy
from server_helpers import DEADLINE_S, Gated, ThreadServer, request_body

# The attacking page: a simple no-cors POST (text/plain: no preflight, the kind a page may send to
# any address), the same as JSON (a preflight first), and a GET of the models it would like to
# read; each outcome written into the page for the test to read.
ATTACK = """<!doctype html><meta charset="utf-8"><title>elsewhere</title><pre id="out"></pre>
<script>
const target = %(target)s, body = %(body)s, out = {};
async function attempt(name, run) {
  try { const r = await run(); out[name] = {type: r.type, status: r.status, text: await r.text()}; }
  catch (e) { out[name] = {error: String(e)}; }
}
(async () => {
  await attempt("no-cors", () => fetch(target + "/v1/systemone", {method: "POST", mode: "no-cors",
      headers: {"Content-Type": "text/plain"}, body}));
  await attempt("json", () => fetch(target + "/v1/systemone", {method: "POST",
      headers: {"Content-Type": "application/json"}, body}));
  await attempt("models", () => fetch(target + "/v1/models"));
  document.getElementById("out").textContent = JSON.stringify(out);
  document.title = "done";
})();
</script>"""


@pytest.fixture(scope="module", autouse=True)
def installed_browser() -> None:
    system_browser()


@contextlib.contextmanager
def page_server() -> Iterator[tuple[str, dict[str, str]]]:
    """A second loopback server (another origin) serving one page, ``page["html"]``: set once the
    target's address is known (the target may need this page's origin first)."""
    page = {"html": ""}

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            data = page["html"].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", page
    finally:
        httpd.shutdown()
        thread.join(DEADLINE_S)


def attack(target: str) -> str:
    return ATTACK % {"target": json.dumps(target), "body": json.dumps(json.dumps(request_body(3)))}


def run_attack(driver, page_url: str) -> dict:
    driver.get(f"{page_url}/")
    WebDriverWait(driver, DEADLINE_S).until(lambda d: d.title == "done", "the page's attempts")
    return json.loads(driver.find_element("id", "out").text)


def test_a_page_of_another_origin_runs_nothing_and_reads_nothing(clef):
    gated = Gated(clef)
    with page_server() as (elsewhere, page), ThreadServer(gated) as srv, chromium() as driver:
        srv.wait_loaded()
        page["html"] = attack(srv.url)
        got = run_attack(driver, elsewhere)
    assert gated.entered == 0, "a cross-site page made the model run"
    assert got["no-cors"] == {"type": "opaque", "status": 0, "text": ""}, got  # nothing readable
    assert "error" in got["json"] and "error" in got["models"], got  # refused preflight / no CORS


def test_a_cors_origin_may_call_the_api_as_json_only(clef):
    gated = Gated(clef)
    with page_server() as (origin, page), \
            ThreadServer(gated, site=SitePolicy(cors_origins=(origin,))) as srv, \
            chromium() as driver:
        srv.wait_loaded()
        page["html"] = attack(srv.url)
        got = run_attack(driver, origin)
    assert gated.entered == 1, "only the JSON request may run"
    assert got["no-cors"]["type"] == "opaque"  # refused (415): a browser must post JSON
    assert got["json"]["status"] == 200 and json.loads(got["json"]["text"])["answers"]
    assert got["models"]["status"] == 200


def test_a_rebound_dns_name_is_refused_even_same_origin(clef):
    """DNS rebinding: the browser resolves the page's own name to 127.0.0.1 (``--host-resolver-rules``);
    the page, same-origin with itself, posts JSON to its own origin, which is our server."""
    gated = Gated(clef)
    with ThreadServer(gated) as srv, \
            chromium(["--host-resolver-rules=MAP rebound.example 127.0.0.1"]) as driver:
        srv.wait_loaded()
        driver.get(f"http://rebound.example:{srv.port}/")
        assert "host_not_allowed" in driver.page_source  # not even the page
        got = driver.execute_async_script("""
            const done = arguments[arguments.length - 1];
            fetch("/v1/systemone", {method: "POST", headers: {"Content-Type": "application/json"},
                                    body: arguments[0]})
              .then(async r => done({status: r.status, text: await r.text()}))
              .catch(e => done({error: String(e)}));""", json.dumps(request_body(4)))
    assert got["status"] == 421 and json.loads(got["text"])["error"]["code"] == "host_not_allowed"
    assert gated.entered == 0
