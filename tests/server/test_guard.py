"""``server.guard`` on a real uvicorn server on a loopback port, over real HTTP (bare sockets where a
client library would not send the forged request): forged Host headers, foreign Origins, simple
cross-site bodies, preflights, the key. Every refusal is checked to be *not executed*: the model's
forward pass is counted (``Gated``), and it did not run.
"""

from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest
from avrik_sdk import Client, noul

from clef_gguf.cli import build_parser
from clef_gguf.server.guard import SitePolicy, parse_host
from clef_gguf.server.settings import ServerSettings
from server_helpers import DEADLINE_S, Gated, ThreadServer, request_body

BODY = json.dumps(request_body(1)).encode()


@pytest.fixture(scope="module")
def gated(clef):
    return Gated(clef)


@pytest.fixture(scope="module")
def srv(gated):
    with ThreadServer(gated) as server:
        server.wait_loaded()
        yield server


def raw(port: int, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One request as written (``head``: request line and headers, CRLF added), on a bare socket;
    (status, headers, body) of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        lines = head.strip("\n").split("\n") + ["Connection: close"]
        if body:
            lines.append(f"Content-Length: {len(body)}")
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, payload


def code_of(payload: bytes) -> str:
    return json.loads(payload)["error"]["code"]


def post(srv, **headers: str) -> str:
    """A decision request with these headers (Host defaults to the right one)."""
    head = {"Host": f"127.0.0.1:{srv.port}", "Content-Type": "application/json", **headers}
    return "POST /v1/systemone HTTP/1.1\n" + "\n".join(f"{k}: {v}" for k, v in head.items() if v is not None)


def refused(srv, gated, head: str, status: int, code: str, body: bytes = BODY) -> None:
    before = gated.entered
    got_status, _headers, payload = raw(srv.port, head, body)
    assert (got_status, code_of(payload)) == (status, code), payload
    assert gated.entered == before, "a refused request reached the model"


def answered(srv, gated, head: str, body: bytes = BODY) -> dict:
    before = gated.entered
    status, _headers, payload = raw(srv.port, head, body)
    assert status == 200, payload
    assert gated.entered == before + 1
    return json.loads(payload)


def test_forged_hosts_are_refused_and_not_executed(srv, gated):
    port = srv.port
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}", "localhost",
                 f"[::2]:{port}", f"127.0.0.2:{port}", f"localhost.evil.example:{port}",
                 "", "bad host", f"127.0.0.1:{port}:{port}"):
        refused(srv, gated, post(srv, Host=host), 421, "host_not_allowed")


def test_two_host_headers_run_nothing(srv, gated):
    before = gated.entered
    status, _h, _payload = raw(srv.port, post(srv) + f"\nHost: evil.example:{srv.port}", BODY)
    assert status in (400, 421)
    assert gated.entered == before


def test_the_loopback_names_on_the_servers_port_are_answered(srv, gated):
    for host in (f"127.0.0.1:{srv.port}", f"localhost:{srv.port}", f"LocalHost:{srv.port}"):
        assert answered(srv, gated, post(srv, Host=host))["answers"]


def test_every_route_checks_the_host_the_page_included(srv):
    for path in ("/", "/ui/app.js", "/health", "/v1/models", "/openapi.json", "/nope"):
        status, _h, payload = raw(srv.port, f"GET {path} HTTP/1.1\nHost: evil.example:{srv.port}")
        assert (status, code_of(payload)) == (421, "host_not_allowed"), path
        assert raw(srv.port, f"GET {path} HTTP/1.1\nHost: 127.0.0.1:{srv.port}")[0] in (200, 404)


def test_foreign_origins_are_refused_with_json_text_and_forms(srv, gated):
    form = b"state=x&questions=y"
    for origin in ("http://evil.example", f"http://127.0.0.1:{srv.port + 1}", "null",
                   f"http://localhost:{srv.port}"):  # another name is another origin
        for content_type, body in (("application/json", BODY), ("text/plain", BODY),
                                   ("application/x-www-form-urlencoded", form),
                                   ("multipart/form-data; boundary=x", form)):
            refused(srv, gated, post(srv, Origin=origin, **{"Content-Type": content_type}), 403,
                    "origin_not_allowed", body)


def test_cross_site_without_an_origin_is_refused(srv, gated):
    refused(srv, gated, post(srv, **{"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}),
            403, "origin_not_allowed")
    # a top-level navigation to the page from another site runs nothing: the page opens
    status, _h, _p = raw(srv.port, f"GET / HTTP/1.1\nHost: 127.0.0.1:{srv.port}\n"
                         "Sec-Fetch-Site: cross-site\nSec-Fetch-Mode: navigate\nSec-Fetch-Dest: document")
    assert status == 200
    status, _h, payload = raw(srv.port, f"GET /v1/models HTTP/1.1\nHost: 127.0.0.1:{srv.port}\n"
                              "Sec-Fetch-Site: cross-site\nSec-Fetch-Mode: no-cors")
    assert (status, code_of(payload)) == (403, "origin_not_allowed")


def test_a_browser_must_send_json_even_from_the_pages_own_origin(srv, gated):
    own = f"http://127.0.0.1:{srv.port}"
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        refused(srv, gated, post(srv, Origin=own, **{"Content-Type": content_type}), 415,
                "unsupported_media_type")
    refused(srv, gated, post(srv, **{"Content-Type": "text/plain", "Sec-Fetch-Site": "same-origin"}),
            415, "unsupported_media_type")
    assert answered(srv, gated, post(srv, Origin=own))["answers"]
    assert answered(srv, gated, post(srv, Origin=own, **{
        "Content-Type": "application/json; charset=utf-8", "Sec-Fetch-Site": "same-origin"}))


def test_clients_without_browser_headers_work_as_before(srv, gated):
    """curl, SDKs and scripts: no Origin, no Sec-Fetch-*; ``curl -d`` posts a form type."""
    assert answered(srv, gated, post(srv, **{"Content-Type": "application/x-www-form-urlencoded"}))
    assert answered(srv, gated, post(srv, **{"Content-Type": None}))
    with Client(srv.url, timeout=DEADLINE_S) as client:
        assert client.decide("x", [noul("ok?")]).answers


def test_no_cors_by_default(srv):
    status, headers, payload = raw(srv.port, f"OPTIONS /v1/systemone HTTP/1.1\nHost: 127.0.0.1:"
                                   f"{srv.port}\nOrigin: http://127.0.0.1:{srv.port + 1}\n"
                                   "Access-Control-Request-Method: POST\n"
                                   "Access-Control-Request-Headers: content-type")
    assert (status, code_of(payload)) == (403, "origin_not_allowed")
    assert "access-control-allow-origin" not in headers


def test_cors_origin_answers_its_preflight_and_no_other(clef):
    gated = Gated(clef)
    with ThreadServer(gated, site=SitePolicy(cors_origins=("http://127.0.0.1:9999",))) as srv:
        srv.wait_loaded()

        def preflight(origin: str) -> tuple[int, dict, bytes]:
            return raw(srv.port, f"OPTIONS /v1/systemone HTTP/1.1\nHost: 127.0.0.1:{srv.port}\n"
                       f"Origin: {origin}\nAccess-Control-Request-Method: POST\n"
                       "Access-Control-Request-Headers: content-type, authorization")

        status, headers, _ = preflight("http://127.0.0.1:9999")
        assert status == 204
        assert headers["access-control-allow-origin"] == "http://127.0.0.1:9999"
        assert "POST" in headers["access-control-allow-methods"]
        assert "content-type" in headers["access-control-allow-headers"].lower()
        for other in ("http://127.0.0.1:9998", "http://evil.example", "https://127.0.0.1:9999"):
            status, headers, payload = preflight(other)
            assert (status, code_of(payload)) == (403, "origin_not_allowed")
            assert "access-control-allow-origin" not in headers
        before = gated.entered
        status, headers, payload = raw(srv.port, post(srv, Origin="http://127.0.0.1:9999"), BODY)
        assert status == 200 and gated.entered == before + 1
        assert headers["access-control-allow-origin"] == "http://127.0.0.1:9999"
        refused(srv, gated, post(srv, Origin="http://127.0.0.1:9998"), 403, "origin_not_allowed")
        # the allowed page can read its refusals too (else the browser shows an opaque failure)
        status, headers, payload = raw(srv.port, post(srv, Origin="http://127.0.0.1:9999",
                                                      **{"Content-Type": "text/plain"}), BODY)
        assert (status, code_of(payload)) == (415, "unsupported_media_type")
        assert headers["access-control-allow-origin"] == "http://127.0.0.1:9999"
        assert gated.entered == before + 1


def test_allowed_host_adds_names_and_star_opens_it(clef, caplog):
    gated = Gated(clef)
    site = SitePolicy(allowed_hosts=("clef.lan", "box.lan:8443"))
    with ThreadServer(gated, site=site) as srv:
        srv.wait_loaded()
        for host in ("clef.lan", f"clef.lan:{srv.port}", "box.lan:8443"):
            assert answered(srv, gated, post(srv, Host=host))
        for host in ("box.lan", f"box.lan:{srv.port}", f"evil.example:{srv.port}"):
            refused(srv, gated, post(srv, Host=host), 421, "host_not_allowed")
    with caplog.at_level(logging.WARNING, "clef_gguf.server"):
        with ThreadServer(gated, site=SitePolicy(allowed_hosts=("*",))) as srv:
            srv.wait_loaded()
            assert answered(srv, gated, post(srv, Host="evil.example"))
    assert "DNS rebinding" in caplog.text


def test_a_refused_host_is_logged_once(clef, caplog):
    with ThreadServer(Gated(clef)) as srv, caplog.at_level(logging.WARNING, "clef_gguf.server"):
        for _ in range(3):
            raw(srv.port, f"GET /health HTTP/1.1\nHost: once.example:{srv.port}")
    assert caplog.text.count("once.example") == 1


def test_the_key_as_bearer_or_x_api_key_and_never_logged(clef, caplog):
    gated = Gated(clef)
    with ThreadServer(gated, api_key="s3cret-key") as srv, \
            caplog.at_level(logging.DEBUG, "clef_gguf.server"):
        srv.wait_loaded()
        url = f"{srv.url}/v1/systemone"
        for headers in ({}, {"Authorization": "Bearer nope"}, {"X-API-Key": "nope"},
                        {"Authorization": "Basic s3cret-key"}, {"X-API-Key": "s3cret-ke"}):
            got = httpx.post(url, json=request_body(), headers=headers, timeout=DEADLINE_S)
            assert (got.status_code, got.json()["error"]["code"]) == (401, "unauthorized")
        for headers in ({"Authorization": "Bearer s3cret-key"}, {"X-API-Key": "s3cret-key"},
                        {"authorization": "bearer s3cret-key"}):
            assert httpx.post(url, json=request_body(), headers=headers,
                              timeout=DEADLINE_S).status_code == 200
        # the host check comes first: a forged Host with the right key is still refused
        status, _h, payload = raw(srv.port, post(srv, Host="evil.example", Authorization="Bearer s3cret-key"), BODY)
        assert (status, code_of(payload)) == (421, "host_not_allowed")
    assert "s3cret" not in caplog.text


def test_flags_and_their_refusals():
    parser = build_parser("serve")
    args = parser.parse_args(["serve", "--model", "m", "--allowed-host", "Clef.LAN",
                              "--allowed-host", "[::1]:8080", "--cors-origin", "http://127.0.0.1:3000/",
                              "--cors-origin", "https://app.example:443"])
    assert ServerSettings.from_args(args).site == SitePolicy(("clef.lan", "[::1]:8080"),
                                                             ("http://127.0.0.1:3000", "https://app.example"))
    assert ServerSettings.from_args(parser.parse_args(["serve", "--model", "m"])).site == SitePolicy()
    for flag, value in (("--allowed-host", "bad host"), ("--allowed-host", "a:99999"),
                        ("--cors-origin", "127.0.0.1:3000"), ("--cors-origin", "http://a.example/path"),
                        ("--cors-origin", "ftp://a.example")):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["serve", "--model", "m", flag, value])
        assert exit_info.value.code == 2


def test_parse_host():
    assert parse_host("LOCALHOST:8080") == ("localhost", 8080)
    assert parse_host("[::1]:80") == ("[::1]", 80)
    assert parse_host("[::1]") == ("[::1]", None)
    for bad in ("", "a b", "a:0", "a:65536", "::1", "a:", "[::1", "a/b"):
        assert parse_host(bad) is None, bad
