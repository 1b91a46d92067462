"""Seeded bad pictures through a ``serve`` process and through ``clef-gguf decide`` processes: every one is a
4xx (exit 2) with a ClefError code naming its field; none is a 5xx, a crash or a hang (every wait bounded);
the server answers a good picture and stays healthy after."""

from __future__ import annotations

import base64
import inspect
import json
import os
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import httpx
import pytest

from clef_gguf.core import errors
from server_helpers import REPO, serve_process, wait_healthy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "media"))
from media_helpers import data_uri, encode, picture, png_uri  # noqa: E402

SEED = 20261201
REQUEST_TIMEOUT_S = 30.0
CLI_TIMEOUT_S = 120.0
QUESTIONS = {"cat": {"type": "noul", "instructions": "Is there a cat?"}}
CODES = {cls.code for cls in vars(errors).values() if inspect.isclass(cls) and issubclass(cls, errors.ClefError)}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def declared_png(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` over a few bytes of pixels (a bomb when large)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + _chunk(b"IEND", b""))


def animated_gif() -> bytes:
    frames = [picture(8, 8, s).convert("P") for s in range(2)]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:])


HEADERS = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff\xe0", b"GIF89a", b"RIFF\x00\x00\x00\x00WEBPVP8 ", b"BM", b"II*\x00")


def bad_images(rng: random.Random) -> list[tuple[str, object]]:
    """(what, image value) for pictures that must be refused, whatever the seed."""
    png, jpeg = encode(picture(48, 32, 1)), encode(picture(48, 32, 2), "JPEG", quality=85)
    cases: list[tuple[str, object]] = []
    for i in range(16):
        source, fmt = (png, "PNG") if i % 2 else (jpeg, "JPEG")
        cut = rng.randrange(1, len(source) // 2)
        cases.append((f"truncated {fmt} at {cut}", data_uri(source[:cut])))
    for i in range(18):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
        cases.append((f"header {i % len(HEADERS)} + junk", data_uri(HEADERS[i % len(HEADERS)] + junk)))
    cases += [("bomb 100000x100000", data_uri(declared_png(100_000, 100_000))),
              ("bomb 12000x12000", data_uri(declared_png(12_000, 12_000))),  # under Pillow's limit, over ours
              ("declared 0x0", data_uri(declared_png(0, 0))),
              ("declared 0x16", data_uri(declared_png(0, 16))),
              ("1x1000: aspect over 200", png_uri(1, 1000)),
              ("1000x2: aspect over 200", png_uri(1000, 2)),
              ("animated GIF", data_uri(animated_gif())),
              ("BMP: a format not decoded", data_uri(encode(picture(8, 8), "BMP"))),
              ("empty data: URI", "data:image/png;base64,"),
              ("data: URI without a comma", "data:image/png;base64"),
              ("data: URI of text", "data:text/plain;base64," + base64.b64encode(b"hello").decode()),
              ("bare data:", "data:"),
              ("base64 of text", base64.b64encode(b"just some words").decode()),
              ("empty string", ""),
              ("garbage base64 in a data: URI", "data:image/png;base64,%%%***"),
              ("a number", 7), ("null", None), ("an object", {"url": "x"}),
              ("avrik object, bad data", {"data": "AAAA", "media_type": "image/png"}),
              ("avrik object, bad media_type", {"data": base64.b64encode(png).decode(), "media_type": 5})]
    for i in range(10):
        garbage = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
                          for _ in range(rng.randrange(1, 200)))
        cases.append((f"random base64 {i}", garbage))
    return cases


def bad_requests(rng: random.Random) -> list[tuple[str, dict]]:
    """Whole request bodies, each with one bad picture (after a good one now and then) or bad media list."""
    out = []
    good = png_uri(16, 16, 3)
    for i, (what, value) in enumerate(bad_images(rng)):
        images = [good, value] if i % 3 == 0 else [value]
        out.append((what, {"state": f"case {i}", "questions": QUESTIONS, "images": images}))
    frame = png_uri(16, 16, 4)
    flags = {"do_sample_frames": False}
    out += [("too many images", {"state": "many", "questions": QUESTIONS, "images": [good] * 40}),
            ("images not a list", {"state": "x", "questions": QUESTIONS, "images": good}),
            ("a video with no frames", {"state": "v", "questions": QUESTIONS, "videos": [[[]]],
                                        "media_kwargs": flags}),
            ("a flat video", {"state": "v", "questions": QUESTIONS, "videos": [[frame, frame]], "media_kwargs": flags}),
            ("a video with a bad frame", {"state": "v", "questions": QUESTIONS, "media_kwargs": flags,
                                          "videos": [[[frame, data_uri(b"\x89PNG\r\n\x1a\n")]]]}),
            ("a video of numbers", {"state": "v", "questions": QUESTIONS, "videos": [[[1, 2]]], "media_kwargs": flags})]
    return out


def check_error(what: str, status: int | None, payload: dict) -> None:
    """A refusal of ours naming the media field (``status`` None: a batch input's, which has none)."""
    assert status is None or status in (413, 422), (what, status, payload)
    error = payload["error"]
    assert error["code"] in CODES and error["code"] not in ("internal_error", "clef_error"), (what, error)
    assert isinstance(error["field"], str) and error["field"].split(".")[0] in ("images", "videos"), (what, error)
    assert error["message"], (what, error)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    with serve_process(tmp_path_factory.mktemp("fuzz-serve"), "--model", str(tiny_model_dir), "--max-length",
                       "2048", "--threads", "1") as (proc, url, _port):
        wait_healthy(proc, url)
        yield proc, url


def test_bad_pictures_through_the_server(served):
    proc, url = served
    cases = bad_requests(random.Random(SEED))
    assert 60 <= len(cases) <= 100
    codes: dict[str, int] = {}
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        for what, request in cases:
            got = http.post("/v1/systemone", json=request)
            check_error(what, got.status_code, got.json())
            codes[got.json()["error"]["code"]] = codes.get(got.json()["error"]["code"], 0) + 1
        batch = http.post("/v1/systemone/batch", json={"requests": [r for _, r in cases[:20]]})
        assert batch.status_code == 200
        for (what, _), result in zip(cases[:20], batch.json()["results"]):
            check_error(what, None, result)
        assert proc.poll() is None, "the server died"
        assert http.get("/health").json()["status"] == "ok"
        good = http.post("/v1/systemone", json={"state": "fine", "questions": QUESTIONS,
                                                "images": [png_uri(24, 24, 5)]})
        assert good.status_code == 200 and 0 <= good.json()["answers"]["cat"]["noul"] <= 1
    print(f"\n{len(cases)} bad media requests: {dict(sorted(codes.items()))}")
    assert {"invalid_media", "media_too_large", "invalid_value"} <= set(codes)


def test_bad_pictures_through_the_cli(tiny_model_dir, tmp_path):
    """A few of the cases as ``clef-gguf decide`` processes, run side by side (each loads the model)."""
    rng = random.Random(SEED)
    cases = [case for case in bad_requests(rng) if case[0].startswith(
        ("truncated PNG", "bomb 100000", "declared 0x0", "1x1000", "garbage base64"))]
    cases = list({what.split(" at ")[0]: (what, r) for what, r in cases}.values())  # one per kind
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for i, (what, request) in enumerate(cases):
        path = tmp_path / f"req{i}.json"
        path.write_text(json.dumps(request))
        procs.append((what, subprocess.Popen(
            [sys.executable, "-m", "clef_gguf.cli", "decide", "--model", str(tiny_model_dir), "--threads", "1",
             "--max-length", "2048", "--request", str(path)], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env)))
    try:
        for what, proc in procs:
            out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
            assert proc.returncode == 2, (what, proc.returncode, err[-2000:])
            payload = json.loads(out)
            check_error(what, None, payload)
            assert "Traceback" not in err, (what, err)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(CLI_TIMEOUT_S)
    assert len(procs) == 5
