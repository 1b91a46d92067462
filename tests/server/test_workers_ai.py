"""``server.workers_ai``: Workers AI's run route, driven by real clients written for Cloudflare's hosted
Clef, each pointed at a live server by its own base-URL setting: the official ``cloudflare`` SDK,
``clef-evals`` and ``clef-router`` (pinned in the test extra). Every answer must equal what
``/v1/systemone`` answers to the same request; a refusal raises each client's own error type with
the server's message.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import cloudflare
import clef_evals
import clef_router
import httpx
import pytest

from clef_gguf.server.guard import SitePolicy
from server_helpers import DEADLINE_S, Gated, ThreadServer, same

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "media"))
from media_helpers import encode, picture  # noqa: E402

PNG = encode(picture(32, 24, 5))
PNG_B64 = base64.b64encode(PNG).decode()
STATE = "Order 1182: the customer was charged twice and asks for a refund within 3 days."
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Should the customer be refunded?",
               "criteria": {"true": "refund", "false": "no refund"}},
    "team": {"type": "choice", "instructions": "Which team handles it?",
             "criteria": {"billing": "payments and refunds", "tech": "bugs", "sales": "new deals"}},
    "anger": {"type": "score", "instructions": "How angry is the customer?",
              "criteria": ["calm", "annoyed", "furious"]},
}
IMAGES = [f"data:image/png;base64,{PNG_B64}", {"content_type": "image/png", "base64": PNG_B64}]
ACCOUNT = "0123456789abcdef"
MODEL = "@cf/cloudflare/clef-flash"


@pytest.fixture(scope="module")
def gated(clef):
    return Gated(clef)


@pytest.fixture(scope="module")
def srv(gated):
    with ThreadServer(gated, api_key="tok") as server:
        server.wait_loaded()
        yield server


def systemone(srv, images: list | None = None, **extra) -> dict:
    """The same request on ``/v1/systemone``: the answer every client must get."""
    body = {"state": STATE, "questions": QUESTIONS, **extra}
    if images:
        body["images"] = [i if isinstance(i, str) else f"data:{i['content_type']};base64,{i['base64']}"
                          for i in images]
    got = httpx.post(f"{srv.url}/v1/systemone", json=body, headers={"Authorization": "Bearer tok"},
                     timeout=DEADLINE_S)
    assert got.status_code == 200, got.text
    return same(got.json())


# ------------------------------------------------------------------ the official SDK
@pytest.mark.parametrize("images", [None, IMAGES], ids=["text", "images"])
def test_the_cloudflare_sdk_gets_the_systemone_answer(srv, images):
    client = cloudflare.Cloudflare(api_token="tok", base_url=f"{srv.url}/client/v4", max_retries=0)
    body = {"model": "clef-flash", "state": STATE, "questions": QUESTIONS}
    if images:
        body["images"] = images
    result = client.ai.run(MODEL, account_id=ACCOUNT, extra_body=body)
    assert same(result) == systemone(srv, images, model="clef-flash")
    # the whole envelope, as sent (its model's slashes arrive percent-encoded: %2F)
    raw = client.ai.with_raw_response.run(MODEL, account_id=ACCOUNT, extra_body=body)
    assert "%2F" in str(raw.http_request.url)
    envelope = raw.json()
    assert set(envelope) == {"result", "success", "errors", "messages"}
    assert (envelope["success"], envelope["errors"], envelope["messages"]) == (True, [], [])


def test_the_cloudflare_sdk_raises_its_own_errors_with_the_servers_message(srv, gated):
    client = cloudflare.Cloudflare(api_token="tok", base_url=f"{srv.url}/client/v4", max_retries=0)
    before = gated.entered
    bad = {"state": STATE, "questions": {"q": {"type": "maybe"}}}
    with pytest.raises(cloudflare.UnprocessableEntityError) as caught:
        client.ai.run(MODEL, account_id=ACCOUNT, extra_body=bad)
    error = caught.value.errors[0]
    assert error.code == 5006 and "noul" in error.message and caught.value.status_code == 422
    assert caught.value.body["errors"][0]["field"] == "questions.q.type"
    wrong_key = cloudflare.Cloudflare(api_token="nope", base_url=f"{srv.url}/client/v4", max_retries=0)
    with pytest.raises(cloudflare.AuthenticationError) as caught:
        wrong_key.ai.run(MODEL, account_id=ACCOUNT, extra_body={"state": STATE, "questions": QUESTIONS})
    assert caught.value.errors[0].code == 10000 and "API key" in caught.value.errors[0].message
    assert gated.entered == before


# ------------------------------------------------------------------ clef-evals
@pytest.mark.parametrize("images", [None, IMAGES], ids=["text", "images"])
def test_clef_evals_gets_the_systemone_answer(srv, images):
    config = clef_evals.ClefConfig(account_id=ACCOUNT, api_token="tok", model=MODEL,
                                   base_url=f"{srv.url}/client/v4", max_retries=0)
    questions = {"refund": clef_evals.Noul("Should the customer be refunded?", criteria_true="refund",
                                           criteria_false="no refund"),
                 "team": clef_evals.Choice("Which team handles it?", QUESTIONS["team"]["criteria"]),
                 "anger": clef_evals.Score("How angry is the customer?", ["calm", "annoyed", "furious"])}
    with clef_evals.ClefClient(config) as client:
        got = client.run(STATE, questions, images=images or [])
    want = systemone(srv, images, model="clef-flash")
    assert got.model == want["model"] == "clef-flash"
    assert got.usage.input_tokens == want["usage"]["input_tokens"]
    answers = want["answers"]
    assert got.answers["refund"].probability == answers["refund"]["noul"]
    assert (got.answers["team"].choice, got.answers["team"].probabilities,
            got.answers["team"].confidence) == (answers["team"]["choice"],
                                                answers["team"]["probabilities"],
                                                answers["team"]["confidence"])
    assert (got.answers["anger"].score, got.answers["anger"].probabilities) == \
        (answers["anger"]["score"], answers["anger"]["probabilities"])


def test_clef_evals_raises_its_error_with_the_servers_message(srv):
    config = clef_evals.ClefConfig(account_id=ACCOUNT, api_token="tok", model=MODEL,
                                   base_url=f"{srv.url}/client/v4", max_retries=0)
    too_long = "word " * 5000  # past the 2,048-token window of the test model
    with clef_evals.ClefClient(config) as client, pytest.raises(clef_evals.ClefAPIError) as caught:
        client.run(too_long, {"q": clef_evals.Noul("Long?")})
    assert (caught.value.status_code, caught.value.error_code) == (413, 5021)
    assert "window" in caught.value.message or "tokens" in caught.value.message


# ------------------------------------------------------------------ clef-router (no /client/v4)
@pytest.mark.parametrize("images", [None, IMAGES], ids=["text", "images"])
def test_clef_router_on_the_bare_base_url(srv, images):
    with clef_router.ClefRouter(account_id=ACCOUNT, api_token="tok", model_selector="clef-flash",
                                base_url=srv.url, max_retries=0) as client:
        got = client.decide(STATE, QUESTIONS, images=images)
    assert client.route_url == f"{srv.url}/accounts/{ACCOUNT}/ai/run/{MODEL}"
    assert same(got.raw_response["result"]) == systemone(srv, images, model="clef-flash")
    assert got.raw_response["success"] is True


def test_clef_router_raises_its_error_with_the_servers_message(srv):
    with clef_router.ClefRouter(account_id=ACCOUNT, api_token="tok", model_selector="clef-flash",
                                base_url=srv.url, max_retries=0) as client, \
            pytest.raises(clef_router.ClefAPIError) as caught:
        client.decide(STATE, {"team": {"type": "choice", "instructions": "Which?",
                                       "criteria": {"a": "one", "b": "two"}}},
                      images=["data:image/png;base64,bm90IGFuIGltYWdl"])
    assert caught.value.status_code == 422 and caught.value.error_code == 5006
    assert "not an image" in str(caught.value)


# ------------------------------------------------------------------ the route itself
def test_model_names_in_the_path_and_the_body(srv):
    url = f"{srv.url}/accounts/{ACCOUNT}/ai/run/@cf/cloudflare/clef"
    got = httpx.post(url, json={"state": STATE, "questions": QUESTIONS},
                     headers={"Authorization": "Bearer tok"}, timeout=DEADLINE_S)
    assert got.status_code == 200 and got.json()["result"]["model"] == "clef"  # echoed, as SystemOne
    got = httpx.post(f"{srv.url}/accounts/x/ai/run/@cf/other/model", json={"state": STATE, "questions": QUESTIONS},
                     headers={"Authorization": "Bearer tok"}, timeout=DEADLINE_S)
    assert got.status_code == 404 and got.json()["errors"][0]["code"] == 5007
    assert got.json()["success"] is False and got.json()["result"] is None


def test_refusals_keep_their_status_and_headers_in_the_envelope(srv):
    url = f"{srv.url}/client/v4/accounts/{ACCOUNT}/ai/run/{MODEL}"
    cases = [
        (httpx.post(url, content=b"{", headers={"Authorization": "Bearer tok"}), 422, 5006),
        (httpx.post(url, json=[1], headers={"Authorization": "Bearer tok"}), 422, 5006),
        (httpx.post(url, json={"state": STATE, "questions": QUESTIONS}), 401, 10000),
        (httpx.get(url, headers={"Authorization": "Bearer tok"}), 405, 5006),
        (httpx.post(url, json={"state": STATE, "questions": QUESTIONS},
                    headers={"Authorization": "Bearer tok", "Host": "evil.example"}), 421, 10001),
        (httpx.post(url, json={"state": STATE, "questions": QUESTIONS},
                    headers={"Authorization": "Bearer tok", "Origin": "http://evil.example"}), 403, 10001),
    ]
    for got, status, code in cases:
        body = got.json()
        assert (got.status_code, body["errors"][0]["code"]) == (status, code), got.text
        assert (body["success"], body["result"], body["messages"]) == (False, None, [])
        assert isinstance(body["errors"][0]["message"], str) and body["errors"][0]["message"]
    assert cases[2][0].headers["www-authenticate"].startswith("Bearer")


def test_the_route_is_in_the_openapi_document(srv):
    spec = httpx.get(f"{srv.url}/openapi.json", headers={"Authorization": "Bearer tok"}).json()
    route = spec["paths"]["/client/v4/accounts/{account_id}/ai/run/{model}"]["post"]
    assert "requestBody" in route and {"200", "422", "429", "503"} <= set(route["responses"])
    images = json.dumps(spec["components"]["schemas"])
    assert "content_type" in images and "Base64Image" in images


def test_no_key_set_ignores_the_bearer_token(clef):
    with ThreadServer(Gated(clef), site=SitePolicy()) as server:
        server.wait_loaded()
        client = cloudflare.Cloudflare(api_token="anything", base_url=f"{server.url}/client/v4",
                                       max_retries=0)
        result = client.ai.run(MODEL, account_id=ACCOUNT,
                               extra_body={"state": STATE, "questions": QUESTIONS})
    assert result["answers"]["refund"]["type"] == "noul"
