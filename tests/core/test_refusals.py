"""``core.refusals``: every capacity refusal carries one of the phrases benchmark kits read as "unsupported",
with its code, field and numbers, on every way in: the request reader, the encoder, the media budgets,
``serve`` (``/v1/systemone`` and the Workers AI route), ``decide`` and ``batch``; and ``--strict`` refuses a
model name this process does not serve, with one model loaded too."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import httpx
import PIL.Image
import pytest

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
             refusals.too_many_questions(65), refusals.canvas("the image has 9x9 pixels", "64 pixels")]
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


def test_media_budgets_say_the_canvas_holds():
    buf = io.BytesIO()
    PIL.Image.new("RGB", (40, 30)).save(buf, "PNG")
    with pytest.raises(errors.MediaTooLarge) as exc:
        sources.decode_image(buf.getvalue(), sources.MediaPolicy(max_pixels=1000), "images.0")
    assert "40x30 pixels, over the budget of 1000" in exc.value.message and said(exc.value.message)
    with pytest.raises(errors.MediaTooLarge) as exc:
        sources.check_count(5, sources.MediaPolicy(max_images=4), "images")
    assert "over the limit of 4" in exc.value.message and said(exc.value.message)


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
