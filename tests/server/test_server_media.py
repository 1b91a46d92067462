"""Images through the server on the tiny model: inline pictures answered exactly as in process; local
paths and URLs refused unless the server was started allowing them (then read and answered); the body
limit; a batch whose one bad picture fails that input only; avrik-sdk's ``image()`` builder."""

from __future__ import annotations

import base64
import contextlib
import functools
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
from avrik_sdk import Client, noul
from avrik_sdk.client import decide_body
from avrik_sdk.questions import image

from clef_gguf import Clef
from clef_gguf.cli import build_parser
from clef_gguf.media.sources import INLINE_ONLY, MediaPolicy, served_sources
from server_helpers import DEADLINE_S, QUESTIONS, ThreadServer, same, serve_process, wait_healthy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "media"))
from media_helpers import data_uri, encode, exif_rotated_jpeg, picture, png_uri  # noqa: E402

PNG = encode(picture(40, 24, 3))


# clef, server, http: tests/server/conftest.py


@contextlib.contextmanager
def picture_server(folder: Path) -> Iterator[str]:
    """``folder`` over HTTP on 127.0.0.1 (a free port), in a thread; yields its base URL."""
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(DEADLINE_S)


def body(*images: str, state: str = "Look at this.") -> dict:
    return {"state": state, "questions": QUESTIONS, "images": list(images)}


def expected(clef: Clef, request: dict) -> dict:
    return same(clef.decide(request))


def _err(response: httpx.Response) -> tuple:
    err = response.json()["error"]
    assert set(err) == {"code", "message", "field"} and err["message"]
    return response.status_code, err["code"], err["field"]


def test_an_inline_image_is_answered_as_in_process(http, clef):
    for images in ([png_uri(16, 16, 1)], [data_uri(exif_rotated_jpeg(40, 24), "image/jpeg"), png_uri(24, 48, 2)],
                   [base64.b64encode(PNG).decode()]):  # raw base64 too
        request = body(*images)
        got = http.post("/v1/systemone", json=request)
        assert got.status_code == 200, got.text
        assert same(got.json()) == expected(clef, request)
    text_only = http.post("/v1/systemone", json={"state": "Look at this.", "questions": QUESTIONS}).json()
    assert got.json()["usage"]["input_tokens"] > text_only["usage"]["input_tokens"]


def test_local_paths_are_refused_unless_allowed(http, clef, tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(PNG)
    for name in (str(path), "a.png", "../etc/passwd"):
        assert _err(http.post("/v1/systemone", json=body(png_uri(8, 8), name))) == \
            (422, "unsupported_media_source", "images.1")
    # a string of base64's alphabet only is read as base64, never as a file: refused all the same
    assert _err(http.post("/v1/systemone", json=body("/etc/passwd")))[::2] == (422, "images.0")
    with ThreadServer(clef, media_policy=MediaPolicy(local_paths=True)) as allowed:
        got = httpx.post(f"{allowed.url}/v1/systemone", json=body(str(path)), timeout=DEADLINE_S)
        assert got.status_code == 200, got.text
        assert same(got.json()) == expected(clef, body(data_uri(PNG)))


def test_urls_are_refused_unless_their_host_is_allowed(http, clef, tmp_path):
    (tmp_path / "pic.png").write_bytes(PNG)
    with picture_server(tmp_path) as base:
        url = f"{base}/pic.png"
        assert _err(http.post("/v1/systemone", json=body(url))) == (422, "unsupported_media_source", "images.0")
        host_port = base.removeprefix("http://")
        with ThreadServer(clef, media_policy=MediaPolicy(local_paths=False, url_allow=(host_port,))) as allowed:
            got = httpx.post(f"{allowed.url}/v1/systemone", json=body(url), timeout=DEADLINE_S)
            assert got.status_code == 200, got.text
            assert same(got.json()) == expected(clef, body(data_uri(PNG)))
            other_port = httpx.post(f"{allowed.url}/v1/systemone", json=body("http://127.0.0.1:9/pic.png"),
                                    timeout=DEADLINE_S)
            assert _err(other_port) == (422, "unsupported_media_source", "images.0")
            missing = httpx.post(f"{allowed.url}/v1/systemone", json=body(f"{base}/nope.png"), timeout=DEADLINE_S)
            assert _err(missing) == (422, "invalid_media", "images.0")
            files = httpx.post(f"{allowed.url}/v1/systemone", json=body(str(tmp_path / "pic.png")),
                               timeout=DEADLINE_S)
            assert _err(files) == (422, "unsupported_media_source", "images.0")  # URLs only


def test_serve_flags_open_files_and_urls_and_limit_the_body(tiny_model_dir, clef, tmp_path):
    """``serve --media-allow-files DIR --media-allow-url HOST:PORT --max-body-bytes N`` as a child process."""
    (tmp_path / "pic.png").write_bytes(PNG)
    want = expected(clef, body(data_uri(PNG)))
    with picture_server(tmp_path) as base, serve_process(
            tmp_path, "--model", str(tiny_model_dir), "--max-length", "2048", "--threads", "1",
            "--media-allow-files", str(tmp_path), "--media-allow-url", base.removeprefix("http://"),
            "--max-body-bytes", "200000") as (proc, url, _port):
        wait_healthy(proc, url)
        for source in (str(tmp_path / "pic.png"), f"{base}/pic.png"):
            got = httpx.post(f"{url}/v1/systemone", json=body(source), timeout=DEADLINE_S)
            assert got.status_code == 200, got.text
            assert same(got.json()) == want
        big = body(data_uri(encode(picture(400, 400, 4))))  # ~500 kB of base64
        assert _err(httpx.post(f"{url}/v1/systemone", json=big, timeout=DEADLINE_S))[:2] == (413, "body_too_large")
        assert httpx.get(f"{url}/health", timeout=DEADLINE_S).status_code == 200


def test_the_serve_flags_policy_defaults_to_inline_images_only():
    def policy(*flags: str) -> MediaPolicy:
        return served_sources(build_parser("serve").parse_args(["serve", "--model", "m", *flags]))

    assert policy() == INLINE_ONLY and INLINE_ONLY.local_paths is False and INLINE_ONLY.url_allow == ()
    assert policy("--media-allow-files", "--media-allow-url", "a.example", "--media-allow-url", "*") == \
        MediaPolicy(local_paths=True, url_allow=("a.example", "*"), file_roots=(Path.cwd().resolve(),))


def test_a_pixel_budget_over_the_limit_is_413_naming_the_field(clef):
    with ThreadServer(clef, media_policy=MediaPolicy(local_paths=False, max_pixels=1000)) as small:
        got = httpx.post(f"{small.url}/v1/systemone", json=body(png_uri(8, 8), png_uri(40, 40)), timeout=DEADLINE_S)
    assert _err(got) == (413, "media_too_large", "images.1")


def test_a_batch_with_one_bad_image_fails_that_input_only(http, clef):
    good = [body(png_uri(16, 16, 5)), body(png_uri(24, 16, 6), state="Second."), {"state": "No picture.",
                                                                                    "questions": QUESTIONS}]
    requests = [good[0], body(data_uri(PNG[:50])), good[1], body("file.png"), good[2]]
    got = http.post("/v1/systemone/batch", json={"requests": requests})
    assert got.status_code == 200, got.text
    results = got.json()["results"]
    assert [r["id"] for r in results] == ["0", "1", "2", "3", "4"]
    assert (results[1]["error"]["code"], results[1]["error"]["field"]) == ("invalid_media", "images.0")
    assert (results[3]["error"]["code"], results[3]["error"]["field"]) == ("unsupported_media_source", "images.0")
    for i, request in zip((0, 2, 4), good):
        assert results[i]["answers"] == expected(clef, request)["answers"]


def test_avrik_image_builder_from_a_path_and_from_bytes(server, clef, tmp_path):
    path = tmp_path / "photo.jpg"
    path.write_bytes(exif_rotated_jpeg(40, 24))
    questions = [noul("Is there a cat?")]
    with Client(server.url, timeout=DEADLINE_S) as client:
        from_path = client.decide("A photo.", questions, images=[image(path)])
        from_bytes = client.decide("A photo.", questions, images=[image(PNG)])
        batch = client.decide_batch([{"id": "ok", "text": "A photo.", "images": [image(PNG)]},
                                     {"id": "bad", "text": "Broken.", "images": [image(b"not a picture")]},
                                     {"id": "plain", "text": "Words only."}], questions)
    for decision, uri in ((from_path, data_uri(path.read_bytes(), "image/jpeg")), (from_bytes, data_uri(PNG))):
        # the builder's {"data", "media_type"} object is the same picture as a data: URI
        want = expected(clef, {"state": "A photo.", "questions": decide_body("", questions)["questions"],
                               "images": [uri]})
        assert decision.model_dump(exclude_none=True, exclude_defaults=True)["answers"] == want["answers"]
        assert decision.usage.input_tokens == want["usage"]["input_tokens"]
    ok, bad, plain = batch.results
    assert ok.error is None and plain.error is None and 0 <= ok["q1"].noul <= 1
    assert (bad.error.code, bad.error.field) == ("invalid_media", "images.0")
