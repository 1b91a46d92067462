"""The wire contract: real responses of every endpoint validate against the served
``/openapi.json`` (generated from ``clef_gguf.server.schema``), and the documented request
schema accepts what the server answers.

Each response is checked against the schema documented for its path, method and status, with
JSON Schema 2020-12 (what OpenAPI 3.1 uses), and must carry the headers documented as required.
"""

import threading

import httpx
import jsonschema
import pytest

from clef_gguf import Clef
from clef_gguf.core import errors
from clef_gguf.pipeline.request import parse_request
from clef_gguf.server import schema
from server_helpers import DEADLINE_S, QUESTIONS, Gated, ThreadServer, request_body, wait_for


@pytest.fixture(scope="module")
def clef(tiny_model_dir):
    with Clef.load(tiny_model_dir, max_length=1024, threads=2) as model:
        yield model


@pytest.fixture(scope="module")
def server(clef):
    with ThreadServer(clef, max_batch=4, max_body_bytes=64 * 1024, api_key="k") as srv:
        yield srv


@pytest.fixture(scope="module")
def spec(server) -> dict:
    return httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()


AUTH = {"Authorization": "Bearer k"}


def _validator(spec: dict, node: dict) -> jsonschema.Draft202012Validator:
    """``node`` as a schema whose ``#/components/...`` references resolve in ``spec``."""
    return jsonschema.Draft202012Validator({**node, "components": spec["components"]})


def conforms(spec: dict, method: str, path: str, response: httpx.Response) -> dict:
    """The response's body, after checking it against what ``spec`` documents for it."""
    documented = spec["paths"][path][method]["responses"]
    assert str(response.status_code) in documented, (path, response.status_code, response.text)
    entry = documented[str(response.status_code)]
    for name, header in entry.get("headers", {}).items():
        if header.get("required"):
            assert name.lower() in response.headers, (path, name)
    body = response.json()
    node = entry["content"]["application/json"]["schema"]
    errors_found = sorted(_validator(spec, node).iter_errors(body), key=str)
    assert not errors_found, f"{method} {path} {response.status_code}: {errors_found[0]}"
    return body


def accepted(spec: dict, path: str, body: object) -> bool:
    node = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return _validator(spec, node).is_valid(body)


def test_single_responses(server, spec):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=DEADLINE_S) as http:
        plain = conforms(spec, "post", "/v1/systemone",
                         http.post("/v1/systemone", json=request_body(1)))
        assert set(plain["usage"]) == {"input_tokens", "output_tokens", "cached_tokens"}
        long = {"state": "word " * 2000, "questions": QUESTIONS, "id": "ignored",
                "options": {"truncate_state": True}}
        full = conforms(spec, "post", "/v1/systemone", http.post("/v1/systemone", json=long))
        assert full["truncated"] is True and full["warnings"][0]["field"] == "id"


def test_batch_responses_of_both_shapes(server, spec):
    avrik = {"state": [{"id": "a", "text": "an input"}, {"id": "x", "text": {"k": 1}},
                       {"id": "bad", "text": "t", "questions": {"q": {"type": "nope"}}}],
             "questions": QUESTIONS}
    mixed = {"state": ["a string input", {"id": 3, "text": [1]}, 7, {"id": "y"}],
             "questions": QUESTIONS, "options": {"truncate_state": True}}
    requests = {"model": "m", "requests": [request_body(2, id="one"), request_body(3),
                                           {"state": "x", "questions": {}}]}
    refusing = {"requests": [5, {"state": 1, "questions": {}}]}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=DEADLINE_S) as http:
        for path, body in (("/v1/systemone", avrik), ("/v1/systemone", requests),
                           ("/v1/systemone/batch", avrik), ("/v1/systemone/batch", requests)):
            valid = {**body, "state": body["state"][:2]} if "state" in body else \
                {**body, "requests": body["requests"][:2]}  # without the refused input
            assert accepted(spec, path, valid)
            out = conforms(spec, "post", path, http.post(path, json=body))
            assert "answers" in out["results"][0] and "error" in out["results"][2]
        for body in (mixed, refusing):  # inputs the document does not describe fail alone
            out = conforms(spec, "post", "/v1/systemone/batch",
                           http.post("/v1/systemone/batch", json=body))
            assert "error" in out["results"][-1]
        assert out["audit"]["input_tokens"] == []


@pytest.mark.parametrize("path, kwargs, status, code", [
    ("/v1/systemone", {"content": b"{bad"}, 422, "invalid_json"),
    ("/v1/systemone", {"json": {"state": 1, "questions": {"q": {"type": "x"}}}}, 422,
     "invalid_question_type"),
    ("/v1/systemone", {"json": {"state": "x" * 70_000, "questions": QUESTIONS}}, 413,
     "body_too_large"),
    ("/v1/systemone", {"json": {"state": "word " * 2000, "questions": QUESTIONS}}, 413,
     "context_too_large"),
    ("/v1/systemone", {"json": {"state": 1, "questions": QUESTIONS}, "headers": {}}, 401,
     "unauthorized"),
    ("/v1/systemone/batch", {"json": {"state": "x"}}, 422, "invalid_batch"),
    ("/v1/systemone/batch", {"json": {"state": ["a"] * 5, "questions": QUESTIONS}}, 422,
     "too_many_inputs"),
    ("/v1/systemone/batch", {"json": {"requests": [{}], "x": 1}}, 422, "unknown_field"),
])
def test_error_responses(server, spec, path, kwargs, status, code):
    headers = kwargs.pop("headers", AUTH)
    response = httpx.post(f"{server.url}{path}", headers=headers, timeout=DEADLINE_S, **kwargs)
    assert response.status_code == status
    assert conforms(spec, "post", path, response)["error"]["code"] == code


def test_models_and_health(server, spec, clef):
    models = conforms(spec, "get", "/v1/models", httpx.get(f"{server.url}/v1/models",
                                                           headers=AUTH))
    assert models["models"][0]["name"] == clef.info["name"]
    assert conforms(spec, "get", "/v1/models", httpx.get(f"{server.url}/v1/models"))[
        "error"]["code"] == "unauthorized"
    health = conforms(spec, "get", "/health", httpx.get(f"{server.url}/health"))
    assert health["status"] == "ok" and health["model_hash"] == clef.provenance.model_hash
    assert (health["gpu_layers"], health["head_device"]) == (clef.info["gpu_layers"], clef.info["head_device"])


def test_loading_failed_and_busy_responses(clef, spec):
    release = threading.Event()

    def slow_load():
        release.wait(DEADLINE_S)
        return Gated(clef)

    with ThreadServer(slow_load) as srv:
        assert conforms(spec, "get", "/health", httpx.get(f"{srv.url}/health")) == \
            {"status": "loading"}
        for method, path in (("get", "/v1/models"), ("post", "/v1/systemone")):
            response = httpx.request(method, f"{srv.url}{path}", json=request_body())
            assert conforms(spec, method, path, response)["error"]["code"] == "model_loading"
        release.set()
        srv.wait_loaded()
        assert httpx.get(f"{srv.url}/health").status_code == 200

    def broken():
        raise errors.ModelNotFound("model not found: /nowhere", field="model")

    with ThreadServer(broken) as srv:
        srv.wait_loaded()
        failed = conforms(spec, "get", "/health", httpx.get(f"{srv.url}/health"))
        assert failed["error"]["code"] == "model_not_found"
        response = httpx.post(f"{srv.url}/v1/systemone", json=request_body())
        assert conforms(spec, "post", "/v1/systemone", response)["error"]["code"] == \
            "model_unavailable"

    gated = Gated(clef)
    with ThreadServer(gated, queue_size=1, tokenize_workers=1) as srv:
        gated.gate.clear()
        threads = [threading.Thread(target=httpx.post, args=(f"{srv.url}/v1/systemone",),
                                    kwargs={"json": request_body(i), "timeout": DEADLINE_S},
                                    daemon=True) for i in range(2)]
        threads[0].start()
        wait_for(lambda: gated.entered == 1, "the first request to reach the model")
        threads[1].start()
        wait_for(lambda: len(srv.queue.waiting_jobs()) == 1, "the second request to queue")
        response = httpx.post(f"{srv.url}/v1/systemone", json=request_body(3))
        assert conforms(spec, "post", "/v1/systemone", response)["error"]["code"] == \
            "queue_full"
        gated.gate.set()
        for t in threads:
            t.join(DEADLINE_S)


@pytest.mark.parametrize("body", [
    {"state": None, "questions": {"": {"type": "noul"}}},  # lenient: an empty question id
    {"state": [1, {"a": None}], "questions": {"q": {"type": "noul", "criteria": {"x": 1}}},
     "id": 1, "calibration": {"v": 2}, "options": {"near_tie_margin": 0.1}, "images": []},
    {"model": None, "state": 1.5, "questions": {
        "c": {"type": "choice", "criteria": {"a": None}, "instructions": ["any", 1]},
        "s": {"type": "score", "criteria": [{"x": 1}], "extra": True}},
     "media_kwargs": {"fps": 1}, "options": None, "videos": None},
])
def test_the_documented_request_accepts_what_the_server_answers(spec, body):
    parse_request(body)  # the server's own validation accepts it
    assert accepted(spec, "/v1/systemone", body)
    schema.SystemOneRequest.model_validate(body)  # the one request model (pipeline.wire)


def test_every_code_the_server_sends_is_registered():
    import inspect

    codes = {c.code for _, c in inspect.getmembers(errors, inspect.isclass)
             if issubclass(c, errors.ClefError)}
    assert {"invalid_batch", "too_many_inputs", "body_too_large", "invalid_content_length",
            "unauthorized", "queue_full", "client_closed", "model_loading", "model_unavailable",
            "shutting_down", "not_found", "method_not_allowed", "not_computed",
            "internal_error", "invalid_setting"} <= codes
