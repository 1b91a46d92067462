"""``"evidence"`` over HTTP: ``/v1/systemone`` (single and batch bodies), the Workers AI route and
``/openapi.json``, on the tiny model served in a thread: the answers are those served without it,
each result carries its evidence, a malformed value is a 422 naming the field."""

from __future__ import annotations

import httpx

from clef_gguf.pipeline.encode import render
from clef_gguf.server import schema
from server_helpers import DEADLINE_S, QUESTIONS, ThreadServer, request_body, same

STATE = "Order 1182: the customer was charged twice and asks for a refund within 3 days."


def post(server: ThreadServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=DEADLINE_S)


def test_single_request_answers_unchanged_with_its_evidence(server):
    body = request_body(3)
    plain = post(server, "/v1/systemone", body)
    got = post(server, "/v1/systemone", {**body, "evidence": {"top": 2, "options": True}})
    assert plain.status_code == got.status_code == 200
    schema.SystemOneResponse.model_validate(got.json())  # what /openapi.json promises, evidence included
    plain, got = same(plain.json()), same(got.json())
    assert got["answers"] == plain["answers"] and got["audit"] == {**plain["audit"], "evidence": "attention"}
    text = render(body["state"])
    for qid, block in got["evidence"]["questions"].items():
        assert set(block["options"]) == set(plain["answers"][qid].get("probabilities", {"true": 0, "false": 0}))
        for span in block["spans"]:
            assert text[span["start"]:span["end"]] == span["text"] and span["path"].startswith("$.")


def test_strict_accepts_it_and_a_malformed_value_is_a_422_naming_the_field(server):
    strict = post(server, "/v1/systemone", {**request_body(1), "evidence": True, "options": {"strict": True}})
    assert strict.status_code == 200 and "warnings" not in strict.json()
    for value, field in (("all", "evidence"), ({"mode": "saliency"}, "evidence.mode"), ({"top": -1}, "evidence.top")):
        bad = post(server, "/v1/systemone", {**request_body(1), "evidence": value})
        assert bad.status_code == 422
        error = bad.json()["error"]
        assert error["code"] == "invalid_value" and error["field"] == field and field in error["message"]


def test_batch_bodies_carry_each_results_evidence(server):
    shared = post(server, "/v1/systemone", {"state": [{"id": "a", "text": STATE}, {"id": "b", "text": "Fine, thanks."}],
                                            "questions": QUESTIONS, "evidence": {"mode": "occlusion", "top": 1}})
    assert shared.status_code == 200
    schema.BatchResponse.model_validate(shared.json())
    results = shared.json()["results"]
    assert [r["id"] for r in results] == ["a", "b"]
    for result, text in zip(results, (STATE, "Fine, thanks.")):
        evidence = result["evidence"]
        assert evidence["mode"] == "occlusion" and evidence["reruns"] >= 1
        for block in evidence["questions"].values():
            (span,) = block["spans"]
            assert text[span["start"]:span["end"]] == span["text"] and "delta_p" in span
    assert shared.json()["audit"]["evidence"] == "occlusion"
    listed = post(server, "/v1/systemone", {"requests": [request_body(1, evidence=True), request_body(2)]})
    schema.BatchResponse.model_validate(listed.json())
    first, second = listed.json()["results"]
    assert "evidence" in first and "evidence" not in second
    plain = post(server, "/v1/systemone", {"requests": [request_body(1), request_body(2)]}).json()
    assert [r["answers"] for r in plain["results"]] == [first["answers"], second["answers"]]


def test_workers_ai_route_wraps_it(server):
    body = {"state": STATE, "questions": QUESTIONS}
    run = "/client/v4/accounts/0123/ai/run/@cf/cloudflare/clef-flash"
    got = post(server, run, {**body, "evidence": True})
    plain = post(server, run, body)
    assert got.status_code == plain.status_code == 200
    result = got.json()["result"]
    assert result["answers"] == plain.json()["result"]["answers"]
    assert set(result["evidence"]["questions"]) == set(QUESTIONS)
    bad = post(server, run, {**body, "evidence": {"top": "3"}})
    assert bad.status_code == 422 and bad.json()["errors"][0]["message"].startswith("'evidence.top'")


def test_openapi_documents_the_key(server):
    schema = httpx.get(f"{server.url}/openapi.json", timeout=DEADLINE_S).json()
    assert "evidence" in str(schema) and "occlusion" in str(schema)
