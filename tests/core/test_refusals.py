"""``core.refusals``: every capacity refusal carries one of the phrases benchmark kits read as "unsupported",
with its code, field and numbers, on every way in: the request reader, the encoder, the media budgets,
``serve`` (``/v1/systemone`` and the Workers AI route), ``decide`` and ``batch``; every 413/422 class of the
registry is a capacity limit with its cases here or named as none, and every raise of one goes through
``core.refusals``; and ``--strict`` refuses a model name this process does not serve, with one model loaded too."""

from __future__ import annotations

import ast
import http.server
import io
import json
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import av
import httpx
import PIL.Image
import pytest

import clef_gguf
from clef_gguf.core import errors, refusals
from clef_gguf.media import sources
from clef_gguf.pipeline.request import parse_request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import DEADLINE_S, ThreadServer  # noqa: E402

WINDOW = 1024
LONG_STATE = "the customer writes again and again " * 500  # far over WINDOW tokens


def said(message: str) -> bool:
    return any(phrase in message for phrase in refusals.KIT_PHRASES)


def choice(n: int) -> dict:
    return {"type": "choice", "criteria": {f"o{i}": f"option {i}" for i in range(n)}}


def score(n: int) -> dict:
    return {"type": "score", "criteria": [f"level {i}" for i in range(n)]}


# (request, error class, field, the words that must be there)
STRICT = [
    ({"state": "x", "questions": {"pick": choice(256)}}, errors.TooManyOptions, "questions.pick.criteria",
     "pick: at most 255 options per choice (got 256)"),
    ({"state": "x", "questions": {"q": choice(1)}}, errors.TooFewOptions, "questions.q.criteria",
     "q: a choice needs at least two options (got 1)"),
    ({"state": "x", "questions": {"s": score(11)}}, errors.TooManyOptions, "questions.s.criteria",
     "s: a score takes 2 to 10 levels (got 11)"),
    ({"state": "x", "questions": {"s": score(1)}}, errors.TooFewOptions, "questions.s.criteria",
     "s: a score takes 2 to 10 levels (got 1)"),
    ({"state": "x", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}, errors.TooManyQuestions,
     "questions", "at most 64 questions per request (got 65)"),
]


def test_every_text_carries_a_kit_phrase():
    texts = [refusals.context_window("20294 tokens (20013 of them state)", 16384),
             refusals.fixed_part("schema", 17000, 16384), refusals.too_few_options("q", "choice", 1),
             refusals.too_many_options("q", "choice", 256), refusals.too_few_options("q", "score", 1),
             refusals.too_many_options("q", "score", 11), refusals.score_levels(12),
             refusals.too_many_questions(65), refusals.canvas("the image has 9x9 pixels", "64 pixels"),
             refusals.request_size("the body is 9 bytes; the limit is 8")]
    assert all(said(t) for t in texts), [t for t in texts if not said(t)]
    assert "maximum context length 16384 tokens" in texts[0] and "truncate_state" in texts[0]  # the advice
    assert texts[1].startswith("schema requires 17000 tokens before state; maximum is 16384")  # the reference's


@pytest.mark.parametrize("request_, cls, field, words", STRICT, ids=lambda v: getattr(v, "code", None))
def test_strict_limits_say_the_kits_words(request_, cls, field, words):
    parse_request(request_)  # the reference answers them: only strict refuses
    with pytest.raises(cls) as exc:
        parse_request(request_, strict=True)
    assert exc.value.field == field and words in exc.value.message and said(exc.value.message)
    assert exc.value.status == 422 and exc.value.code == cls.code


# The 413 and 422 classes of the registry that are no capacity limit: a malformed request, file or label.
NOT_CAPACITY = {errors.InvalidRequest, errors.InvalidJson, errors.MissingField, errors.UnknownField,
                errors.InvalidValue, errors.InvalidQuestionType, errors.NoQuestions, errors.EmptyQuestionId,
                errors.InvalidCriteria, errors.Unsupported, errors.UnsupportedMediaSource, errors.InvalidMedia,
                errors.DuplicateId, errors.InvalidInput, errors.CorruptOutput, errors.InvalidBatch,
                errors.InvalidLabel, errors.WrongCalibration, errors.CalibrationNotBetter}


def registry() -> set[type[errors.ClefError]]:
    return {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ClefError)
            and c.status in (413, 422)}


def capacity_classes() -> set[type[errors.ClefError]]:
    return registry() - NOT_CAPACITY


def raised(cls: type[errors.ClefError], fn) -> tuple[str, int, str]:
    with pytest.raises(cls) as exc:
        fn()
    return exc.value.code, exc.value.status, exc.value.message


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    PIL.Image.new("RGB", (width, height)).save(buf, "PNG")
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares a huge size: Pillow reads the size before any pixel."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


def video(fx, **limits) -> tuple[str, int, str]:
    from clef_gguf.media import load_processor_config, load_video, parse_media_kwargs
    from clef_gguf.media.config import video_settings

    path = fx.getfixturevalue("tmp_path") / "clip.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for _ in range(8):
            container.mux(stream.encode(av.VideoFrame(64, 48, "yuv420p")))
        container.mux(stream.encode())
    settings = video_settings(load_processor_config(fx.getfixturevalue("tiny_release")), parse_media_kwargs(None)[0])
    policy = sources.MediaPolicy(local_paths=True, **limits)
    return raised(errors.MediaTooLarge, lambda: load_video(str(path), policy, settings, "videos.0"))


def url_body(fx) -> tuple[str, int, str]:
    class Big(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"x" * 5000)

        def log_message(self, *args) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Big) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        policy = sources.MediaPolicy(url_allow=("127.0.0.1",), url_max_bytes=1000)
        try:
            return raised(errors.MediaTooLarge, lambda: sources.read_source(
                f"http://127.0.0.1:{server.server_address[1]}/a.png", policy, "images.0"))
        finally:
            server.shutdown()


def file_bytes(fx) -> tuple[str, int, str]:
    root = fx.getfixturevalue("tmp_path")
    (root / "big.png").write_bytes(png(40, 30) + b"\0" * 4096)
    policy = sources.MediaPolicy(local_paths=True, file_roots=(root.resolve(),), url_max_bytes=1000)
    return raised(errors.MediaTooLarge, lambda: sources.read_source(str(root / "big.png"), policy, "images.0"))


def prepared(fx, request_: dict) -> tuple[str, int, str]:
    return raised(errors.ContextTooLarge, lambda: fx.getfixturevalue("clef").prepare(request_))


def posted(fx, path: str, **kwargs) -> tuple[str, int, str]:
    got = httpx.post(f"{fx.getfixturevalue('small_srv').url}{path}", timeout=DEADLINE_S, **kwargs)
    return got.json()["error"]["code"], got.status_code, got.text


def chunked(n: int):
    yield b'{"state": "'
    yield b"x" * n
    yield b'", "questions": {"q": {"type": "noul"}}}'


# Every way a capacity class is raised, through the real code path: (class, fx -> (code, status, message)).
CASES = {
    "state over the window": (errors.ContextTooLarge, lambda fx: prepared(fx, {"state": LONG_STATE, "questions": {
        "q": {"type": "noul"}}})),
    "schema over the window": (errors.ContextTooLarge, lambda fx: prepared(fx, {"state": "x", "questions": {
        f"question{i}": {"type": "noul", "instructions": "is it so? " * 10} for i in range(60)}})),
    **{f"strict {cls.code} {i}": (cls, lambda fx, r=r, cls=cls: raised(cls, lambda: parse_request(r, strict=True)))
       for i, (r, cls, _, _) in enumerate(STRICT)},
    "image pixels": (errors.MediaTooLarge, lambda fx: raised(errors.MediaTooLarge, lambda: sources.decode_image(
        png(40, 30), sources.MediaPolicy(max_pixels=1000), "images.0"))),
    "decompression bomb": (errors.MediaTooLarge, lambda fx: raised(errors.MediaTooLarge, lambda: sources.decode_image(
        png_header_only(20_000, 20_000), sources.MediaPolicy(max_pixels=10**12), "images.0"))),
    "image count": (errors.MediaTooLarge, lambda fx: raised(errors.MediaTooLarge, lambda: sources.check_count(
        5, sources.MediaPolicy(max_images=4), "images"))),
    "image file bytes": (errors.MediaTooLarge, file_bytes),
    "image URL bytes": (errors.MediaTooLarge, url_body),
    "video duration": (errors.MediaTooLarge, lambda fx: video(fx, max_video_seconds=0.5)),
    "video frame pixels": (errors.MediaTooLarge, lambda fx: video(fx, max_pixels=64 * 48 - 1)),
    "video pixels": (errors.MediaTooLarge, lambda fx: video(fx, max_video_pixels=64 * 48)),
    "video decode time": (errors.MediaTooLarge, lambda fx: video(fx, video_decode_s=0)),
    "body by Content-Length": (errors.BodyTooLarge, lambda fx: posted(
        fx, "/v1/systemone", json={"state": "x" * 3000, "questions": {"q": {"type": "noul"}}})),
    "chunked body": (errors.BodyTooLarge, lambda fx: posted(fx, "/v1/systemone", content=chunked(3000))),
    "batch inputs": (errors.TooManyInputs, lambda fx: posted(
        fx, "/v1/systemone/batch", json={"state": ["a", "b", "c"], "questions": {"q": {"type": "noul"}}})),
}


def test_every_413_and_422_class_is_a_capacity_limit_with_cases_or_named_as_none():
    assert NOT_CAPACITY <= registry()  # a renamed or removed class is said here
    assert capacity_classes() == {cls for cls, _ in CASES.values()}, "a new 413/422 class: give it CASES or " \
        "name it in NOT_CAPACITY"


@pytest.mark.parametrize("case", CASES)
def test_every_capacity_refusal_carries_a_kit_phrase(request, case):
    cls, make = CASES[case]
    code, status, message = make(request)
    assert (code, status) == (cls.code, cls.status) and said(message), message


def test_every_raise_of_a_capacity_class_words_it_through_core_refusals():
    """A new raise site of a capacity class (a new limit of the same kind) cannot skip the kit's words."""
    names = {cls.__name__ for cls in capacity_classes()}
    package = Path(clef_gguf.__file__).parent
    unworded = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "errors.py" and path.parent.name == "core":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name not in names:
                continue
            message = node.args[0] if node.args else None
            if not (isinstance(message, ast.Call) and isinstance(message.func, ast.Attribute)
                    and getattr(message.func.value, "id", None) == "refusals"):
                unworded.append(f"{path.relative_to(package)}:{node.lineno} {name}")
    assert not unworded, unworded


@pytest.fixture(scope="module")
def clef(tiny_model_dir):
    from clef_gguf import Clef

    with Clef.load(tiny_model_dir, max_length=WINDOW, threads=1, strict=True) as model:
        yield model


def test_the_window_says_context_window_and_maximum_context_length(clef):
    with pytest.raises(errors.ContextTooLarge) as exc:
        clef.prepare({"state": LONG_STATE, "questions": {"q": {"type": "noul"}}})
    message = exc.value.message
    assert exc.value.field == "state" and exc.value.status == 413 and said(message)
    assert f"the model's context window (maximum context length {WINDOW} tokens)" in message
    assert "the request needs" in message and "truncate_state" in message
    many = {f"question{i}": {"type": "noul", "instructions": "is it so? " * 10} for i in range(60)}
    with pytest.raises(errors.ContextTooLarge) as exc:  # the schema alone is over the window
        clef.prepare({"state": "x", "questions": many})
    assert exc.value.field == "questions" and said(exc.value.message) and "before state" in exc.value.message


@pytest.fixture(scope="module")
def small_srv(clef):
    from clef_gguf.runtime.registry import Models

    with ThreadServer(Models.of(clef), max_body_bytes=2000, max_batch=2) as server:
        yield server


@pytest.fixture(scope="module")
def srv(clef):
    from clef_gguf.runtime.registry import Models

    with ThreadServer(Models.of(clef)) as server:  # as serve --strict serves one model
        yield server


@pytest.mark.parametrize("route", ["/v1/systemone", "/client/v4/accounts/acc/ai/run/@cf/cloudflare/{name}"])
def test_serve_and_the_workers_ai_route_refuse_in_the_kits_words(srv, clef, route):
    from clef_gguf.runtime.registry import Models

    workers = route != "/v1/systemone"
    route = route.format(name=clef.name)
    with httpx.Client(base_url=srv.url, timeout=DEADLINE_S) as http:
        for body, status, code in [({"state": LONG_STATE, "questions": {"q": {"type": "noul"}}}, 413,
                                    "context_too_large"),
                                   (STRICT[0][0], 422, "too_many_options"), (STRICT[2][0], 422, "too_many_options")]:
            got = http.post(route, json=body)
            assert got.status_code == status and said(got.text), got.text
            error = got.json()["errors"][0] if workers else got.json()["error"]
            assert error["code"] == ((5021 if code == "context_too_large" else 5006) if workers else code)
        # --strict with one model: a name it does not serve is refused, the ones it serves answer
        name = clef.name
        if not workers:
            got = http.post(route, json={"model": "made-up", "state": "x", "questions": {"q": {"type": "noul"}}})
            assert got.status_code == 404 and got.json()["error"]["code"] == "unknown_model"
            assert name in got.json()["error"]["message"]
        for served in (name, *Models.of(clef).aliases):
            ok = http.post("/v1/systemone", json={"model": served, "state": "x", "questions": {"q": {"type": "noul"}}})
            assert ok.status_code == 200 and ok.json()["model"] == served


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clef_gguf.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_decide_and_batch_refuse_in_the_kits_words(tiny_model_dir, tmp_path):
    flags = ["--model", str(tiny_model_dir), "--threads", "1", "--max-length", str(WINDOW), "--strict"]
    long = {"state": LONG_STATE, "questions": {"q": {"type": "noul"}}}
    proc = _cli("decide", *flags, stdin=json.dumps(long))
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"]["code"] == "context_too_large"
    assert said(json.loads(proc.stdout)["error"]["message"])
    proc = _cli("decide", *flags, stdin=json.dumps(dict(long, state="x", model="made-up")))
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"]["code"] == "unknown_model"
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in (long, STRICT[1][0], STRICT[4][0])) + "\n")
    proc = _cli("batch", *flags, "-i", str(src), "-o", str(out))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    codes = [line["error"]["code"] for line in lines]
    assert codes == ["context_too_large", "too_few_options", "too_many_questions"], proc.stderr
    assert all(said(line["error"]["message"]) for line in lines)
