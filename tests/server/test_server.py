"""The local server on the tiny model, through a real third-party client (avrik-sdk 1.0.0) and raw
HTTP: answers, batches, models, health, error bodies, auth, limits, disconnects and shutdown.

Servers run in-process under uvicorn on 127.0.0.1 (a free port). Where a queue state matters, the
model's forward pass is held on an Event (``Gated``), so every state is reached exactly.
"""

import json
import logging
import socket
import threading

import httpx
import pytest
from avrik_sdk import AvrikError, Client, RateLimited, choice, noul, score

from clef_gguf import Clef
from clef_gguf.core import errors
from clef_gguf.server.app import DEFAULT_MAX_BODY
from server_helpers import (raw_post, same, DEADLINE_S, QUESTIONS, Gated, ThreadServer, request_body,
                            wait_for)


# clef, server, http: tests/server/conftest.py


def expected(clef, body: dict) -> dict:
    """What the server must answer: exactly the in-process ``Clef.decide`` (but for what the
    state cache held)."""
    return same(clef.decide(json.loads(json.dumps(body))))


def in_background(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, out


# ------------------------------------------------------------------ avrik-sdk, the real client
def test_avrik_decide_noul_choice_score(server, clef):
    questions = {"urgent": noul("Is this urgent?"),
                 "team": choice("Which team?", {"billing": "Payments", "tech": "Bugs"}),
                 "anger": score("How angry?", ["calm", "annoyed", "furious"])}
    state = {"ticket": "Refund not received after 14 days", "amount": 129.5}
    with Client(server.url, timeout=DEADLINE_S) as client:
        decision = client.decide(state, questions, request_id="avrik-1")
    assert decision.model == clef.info["name"]  # no model sent: the served model's name
    assert decision["urgent"].type == "noul" and 0 <= decision["urgent"].noul <= 1
    team = decision["team"]
    assert team.choice in ("billing", "tech") and list(team.probabilities) == ["billing", "tech"]
    assert decision["anger"].legend == {"0": "calm", "1": "annoyed", "2": "furious"}
    assert decision.audit.backend == "llama-cpp-python" and decision.audit.model_hash
    want = expected(clef, {"state": state, "questions": questions})
    assert decision.model_dump(exclude_none=True, exclude_defaults=True)["answers"] == \
        want["answers"]
    assert decision.usage.input_tokens == want["usage"]["input_tokens"]


def test_avrik_parses_a_response_with_warnings(server, http):
    # Keys the reference ignores are answered and named in a top-level "warnings" list.
    with Client(server.url, timeout=DEADLINE_S) as client:
        decision = client.decide("hello", {"greet": noul("Greeting?")}, calibration="v2",
                                 options={"near_tie_margin": 0.1})
    assert 0 <= decision["greet"].noul <= 1
    raw = http.post("/v1/systemone", json={"state": "hello", "id": "rec-1",
                                           "questions": {"q": {"type": "noul"}}}).json()
    assert raw["warnings"] == [{"code": "ignored_field", "field": "id",
                                "message": "'id' was ignored: not a SystemOne request key"}]


def test_avrik_model_is_echoed(server):
    with Client(server.url, timeout=DEADLINE_S) as client:
        assert client.decide("hello", [noul("Greeting?")], model="my-clef").model == "my-clef"


def test_avrik_decide_batch(server, clef):
    inputs = ["The printer is on fire.", {"id": "x", "text": {"ticket": "late refund"}},
              {"id": "bad", "text": "t", "questions": {"q": {"type": "nope"}}}]
    with Client(server.url, timeout=DEADLINE_S) as client:
        decision = client.decide_batch(inputs, QUESTIONS)
    assert [r.id for r in decision.results] == ["0", "x", "bad"]
    assert decision.results[2].error.code == "invalid_question_type"
    assert decision.results[2].answers is None
    singles = [expected(clef, {"state": s, "questions": QUESTIONS})
               for s in ("The printer is on fire.", {"ticket": "late refund"})]
    for result, single in zip(decision.results, singles):
        assert result.model_dump(exclude_none=True, exclude_defaults=True)["answers"] == \
            single["answers"]
    assert decision.usage.input_tokens == sum(s["usage"]["input_tokens"] for s in singles)
    assert decision.audit.input_tokens == [s["usage"]["input_tokens"] for s in singles]


def test_avrik_models_and_health(server, clef):
    with Client(server.url) as client:
        (model,) = client.models()
        health = client.health()
    assert model.name == clef.info["name"]
    assert model.quant == clef.info["quant"] and model.files == clef.info["files"]
    assert health.ok and health.model_hash == clef.provenance.model_hash


@pytest.mark.parametrize("questions, code, field", [
    ({"q": {"type": "maybe"}}, "invalid_question_type", "questions.q.type"),
    ({"q": {"type": "choice", "criteria": ["a", "b"]}}, "invalid_criteria",
     "questions.q.criteria"),
])
def test_avrik_parses_our_422(server, questions, code, field):
    with Client(server.url) as client, pytest.raises(AvrikError) as info:
        client.decide("state", questions, request_id="bad-1")
    err = info.value
    assert (err.status, err.code, err.field) == (422, code, field)
    assert err.request_id == "bad-1" and not isinstance(err, RateLimited)


def test_avrik_bad_media_is_refused_clearly(server):
    # "AAAA" is three zero bytes: no picture (images that are pictures: test_server_media.py)
    with Client(server.url) as client, pytest.raises(AvrikError) as info:
        client.decide("look", [noul("Cat?")], images=[{"data": "AAAA", "media_type": "image/png"}])
    assert (info.value.status, info.value.code, info.value.field) == (422, "invalid_media", "images.0")


def test_avrik_parses_our_429(clef):
    gated = Gated(clef)
    with ThreadServer(gated, queue_size=1) as srv:
        gated.gate.clear()
        first, out1 = in_background(httpx.post, f"{srv.url}/v1/systemone", json=request_body(1),
                                    timeout=DEADLINE_S)
        wait_for(lambda: gated.entered == 1, "the first request to reach the model")
        second, out2 = in_background(httpx.post, f"{srv.url}/v1/systemone",
                                     json=request_body(2), timeout=DEADLINE_S)
        wait_for(lambda: len(srv.queue.waiting_jobs()) == 1, "the second request to queue")
        with Client(srv.url) as client, pytest.raises(RateLimited) as info:
            client.decide("one too many", [noul("Busy?")])
        assert (info.value.status, info.value.code) == (429, "queue_full")
        assert info.value.retry_after is not None and info.value.retry_after >= 1
        gated.gate.set()
        first.join(DEADLINE_S)
        second.join(DEADLINE_S)
        assert [out1[0].status_code, out2[0].status_code] == [200, 200]
        with Client(srv.url) as client:  # recovered
            assert client.decide("calm again", [noul("Busy?")]).answers


# ------------------------------------------------------------------ the wire
def test_same_request_same_bytes_and_request_ids(http):
    body = json.dumps(request_body(7))
    first = http.post("/v1/systemone", content=body)
    a = http.post("/v1/systemone", content=body, headers={"X-Request-Id": "abc-123"})
    b = http.post("/v1/systemone", content=json.dumps(json.loads(body), indent=2))
    assert first.status_code == a.status_code == b.status_code == 200
    assert a.content == b.content  # repeats: the same bytes, the whole prompt from the cache
    assert same(first.content) == same(a.content)
    assert a.json()["usage"]["cached_tokens"] == a.json()["usage"]["input_tokens"]
    assert a.headers["x-request-id"] == "abc-123"
    generated = b.headers["x-request-id"]
    assert len(generated) == 32 and generated != http.post("/v1/systemone", content=body) \
        .headers["x-request-id"]
    assert b"abc-123" not in a.content and "server-timing" in a.headers
    weird = http.post("/v1/systemone", content=body, headers={"X-Request-Id": "no spaces ok?"})
    assert weird.headers["x-request-id"] != "no spaces ok?"


def test_answers_equal_in_process_decide(http, clef):
    for i in range(3):
        body = request_body(i, model="tiny-echo")
        assert same(http.post("/v1/systemone", json=body).json()) == expected(clef, body)


def _err(response: httpx.Response) -> tuple:
    err = response.json()["error"]
    assert set(err) == {"code", "message", "field"} and err["message"]
    return response.status_code, err["code"], err["field"]


@pytest.mark.parametrize("raw, code, field", [
    (b"{bad json", "invalid_json", None),
    (b"", "invalid_json", None),
    (b'{"state": NaN, "questions": {"q": {"type": "noul"}}}', "invalid_json", None),
    (b"\xff\xfe", "invalid_json", None),
    (b"[1, 2]", "invalid_value", None),
    (b'{"questions": {"q": {"type": "noul"}}}', "missing_field", "state"),
    (b'{"state": 1, "questions": {}}', "no_questions", "questions"),
    (b'{"state": 1, "questions": {"q": {"type": "noul"}}, "extra": 1, "options": {"strict": true}}',
     "unknown_field", "extra"),
    (b'{"state": 1, "questions": {"q": {"type": "score", "criteria": ["only"]}}, '
     b'"options": {"strict": true}}', "too_few_options", "questions.q.criteria"),
    (b'{"state": 1, "state": 2, "questions": {"q": {"type": "noul"}}}', "invalid_json", "state"),
    (b'{"state": 1, "questions": {"q": {"type": "noul"}}, "videos": [1]}', "invalid_value",
     "videos.0"),
    (b'{"state": [' + b"7" * 5000 + b'], "questions": {"q": {"type": "noul"}}}', "invalid_value", "state.0"),
])
def test_422_error_bodies(http, raw, code, field):
    assert _err(http.post("/v1/systemone", content=raw)) == (422, code, field)


def test_unknown_route_and_method_use_the_error_body(http):
    assert _err(http.get("/v1/nope"))[:2] == (404, "not_found")
    assert _err(http.get("/v1/systemone"))[:2] == (405, "method_not_allowed")
    assert _err(http.post("/v1/systemone?batch=perhaps", json={}))[:2] == (422, "invalid_value")


def test_openapi_schema(http):
    spec = http.get("/openapi.json").json()
    assert {"/v1/systemone", "/v1/systemone/batch", "/v1/models", "/health"} <= set(spec["paths"])
    post = spec["paths"]["/v1/systemone"]["post"]
    single, batch = post["requestBody"]["content"]["application/json"]["schema"]["anyOf"]

    def resolve(node: dict) -> dict:  # "#/components/schemas/Name" -> its schema
        return spec["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]] if "$ref" in node \
            else node

    assert "questions" in resolve(single)["properties"] and len(batch["oneOf"]) == 2
    assert "cached_tokens" in spec["components"]["schemas"]["Usage"]["required"]
    assert {"200", "413", "422", "429"} <= set(post["responses"])


def test_models_entry(http, clef):
    listed = http.get("/v1/models").json()
    (entry,) = listed["models"]
    # the limits the page checks a request against before sending it (DEFAULT_MAX_IMAGES: 32)
    assert listed["limits"] == {"max_body_bytes": DEFAULT_MAX_BODY, "max_images": 32}
    assert entry["name"] == clef.info["name"] and entry["revision"] == clef.info["revision"]
    assert all(len(h) == 64 for h in entry["files"].values() if h)


# ------------------------------------------------------------------ batches
def test_batch_of_full_requests(http, clef):
    body = {"model": "m", "requests": [request_body(1, id="one"), 5, request_body(2),
                                       {"state": "x", "questions": {"q": {"type": "bogus"}}}]}
    out = http.post("/v1/systemone/batch", json=body).json()
    assert [r["id"] for r in out["results"]] == ["one", "1", "2", "3"]
    assert out["results"][0]["answers"] == expected(clef, request_body(1))["answers"]
    assert out["results"][2]["answers"] == expected(clef, request_body(2))["answers"]
    assert out["results"][1]["error"]["field"] == "requests.1"
    assert out["results"][3]["error"]["code"] == "invalid_question_type"
    assert out["model"] == "m" and len(out["audit"]["input_tokens"]) == 2


def test_batch_where_every_input_is_refused_still_answers(http, clef):
    out = http.post("/v1/systemone/batch", json={"state": [{"id": "a", "text": "t"}],
                                                 "questions": {"q": {"type": "x"}}})
    assert out.status_code == 200
    assert out.json()["results"][0]["error"]["code"] == "invalid_question_type"
    assert out.json()["audit"]["model_hash"] == clef.provenance.model_hash


def test_batch_shape_errors(http):
    assert _err(http.post("/v1/systemone/batch", json={"state": "x"}))[:2] == \
        (422, "invalid_batch")
    assert _err(http.post("/v1/systemone/batch", json={"requests": []}))[:2] == \
        (422, "invalid_batch")
    too_many = {"state": [str(i) for i in range(9)], "questions": QUESTIONS}  # max_batch=8
    assert _err(http.post("/v1/systemone/batch", json=too_many)) == \
        (422, "too_many_inputs", "state")
    assert _err(http.post("/v1/systemone/batch", json={"requests": [{}], "x": 1}))[:2] == \
        (422, "unknown_field")


def test_batch_detection_can_be_switched_off(http, clef):
    body = {"state": [{"id": "a", "text": "t"}], "questions": {"q": {"type": "noul"}}}
    single = http.post("/v1/systemone?batch=false", json=body).json()
    assert same(single) == expected(clef, body)  # the list is the state itself
    assert "results" in http.post("/v1/systemone", json=body).json()


# ------------------------------------------------------------------ limits, auth, loading
def test_body_over_the_limit_is_413(clef):
    with ThreadServer(clef, max_body_bytes=2000) as srv, httpx.Client(base_url=srv.url) as http:
        small = request_body(1)
        assert http.post("/v1/systemone", json=small).status_code == 200
        big = request_body(1, model="x" * 3000)
        assert _err(http.post("/v1/systemone", json=big))[:2] == (413, "body_too_large")
        chunks = (json.dumps(big)[i:i + 500].encode() for i in range(0, 3200, 500))
        assert _err(http.post("/v1/systemone", content=chunks))[:2] == (413, "body_too_large")


def test_too_long_for_the_window_is_413_unless_truncation_is_asked(tiny_model_dir):
    with Clef.load(tiny_model_dir, max_length=512, threads=2) as short, \
            ThreadServer(short) as srv, httpx.Client(base_url=srv.url, timeout=DEADLINE_S) as http:
        body = {"state": "word " * 2000, "questions": {"q": {"type": "noul"}}}
        status, code, _ = _err(http.post("/v1/systemone", json=body))
        assert (status, code) == (413, "context_too_large")
        body["options"] = {"truncate_state": True}
        out = http.post("/v1/systemone", json=body).json()
        assert out["truncated"] is True and out["usage"]["input_tokens"] <= 512
        with Client(srv.url) as client:
            with pytest.raises(AvrikError) as info:
                client.decide("word " * 2000, [noul("Long?")])
            assert (info.value.status, info.value.code) == (413, "context_too_large")
            assert client.decide("word " * 2000, [noul("Long?")],
                                 options={"truncate_state": True}).truncated is True


def test_api_key(clef):
    with ThreadServer(clef, api_key="s3cret") as srv:
        url = f"{srv.url}/v1/systemone"
        missing = httpx.post(url, json=request_body())
        assert _err(missing)[:2] == (401, "unauthorized")
        assert missing.headers["www-authenticate"].startswith("Bearer")
        wrong = httpx.post(url, json=request_body(), headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        right = httpx.post(url, json=request_body(), headers={"Authorization": "Bearer s3cret"},
                           timeout=DEADLINE_S)
        assert right.status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200  # open for liveness probes
        assert httpx.get(f"{srv.url}/openapi.json").status_code == 401
        with Client(srv.url, api_key="s3cret", timeout=DEADLINE_S) as client:
            assert client.decide("x", [noul("ok?")]).answers
            assert client.models()[0].name == clef.info["name"]
        with Client(srv.url) as client, pytest.raises(AvrikError) as info:
            client.decide("x", [noul("ok?")])
        assert (info.value.status, info.value.code) == (401, "unauthorized")


def test_health_while_loading_then_ok(clef):
    release = threading.Event()

    def slow_load():
        release.wait(DEADLINE_S)
        return Gated(clef)  # its close() leaves the shared model open

    with ThreadServer(slow_load) as srv, Client(srv.url) as client:
        loading = httpx.get(f"{srv.url}/health")
        assert loading.status_code == 503 and loading.json() == {"status": "loading"}
        assert int(loading.headers["retry-after"]) >= 1
        assert not client.health().ok
        with pytest.raises(RateLimited) as info:
            client.decide("x", [noul("ready?")])
        assert info.value.code == "model_loading" and info.value.retry_after >= 1
        with pytest.raises(RateLimited):
            client.models()
        release.set()
        srv.wait_loaded()
        assert client.health().ok
        assert client.decide("x", [noul("ready?")]).answers


def test_failed_load_is_reported(clef):
    def broken():
        raise errors.ModelNotFound("model not found: /nowhere", field="model")

    with ThreadServer(broken) as srv:
        srv.wait_loaded()
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "model_not_found"
        assert _err(httpx.post(f"{srv.url}/v1/systemone", json=request_body()))[:2] == \
            (503, "model_unavailable")


def test_serves_a_model_directory_loaded_in_the_background(tiny_model_dir, clef):
    with ThreadServer(str(tiny_model_dir), load_kwargs={"max_length": 2048, "threads": 2}) as srv:
        srv.wait_loaded()
        assert httpx.get(f"{srv.url}/health").status_code == 200
        body = request_body(5)
        response = httpx.post(f"{srv.url}/v1/systemone", json=body, timeout=DEADLINE_S)
        assert same(response.json()) == expected(clef, body)


def test_a_failing_pass_is_a_500_with_the_error_body(clef):
    class Broken(Gated):
        def run(self, prepared):
            raise RuntimeError("boom")

    with ThreadServer(Broken(clef)) as srv:
        response = httpx.post(f"{srv.url}/v1/systemone", json=request_body(), timeout=DEADLINE_S)
        assert _err(response) == (500, "internal_error", None)
        assert "boom" in response.json()["error"]["message"] and response.headers["x-request-id"]
        batch = httpx.post(f"{srv.url}/v1/systemone/batch", json={"requests": [request_body()]},
                           timeout=DEADLINE_S)
        # A batch answers 200 and the failure stays inside the input's result.
        assert batch.status_code == 200
        assert batch.json()["results"][0]["error"]["code"] == "internal_error"


# ------------------------------------------------------------------ disconnects, shutdown
def _raw_post(port: int, body: dict) -> socket.socket:
    return raw_post(port, json.dumps(body).encode())


def test_client_gone_while_queued_is_never_computed(clef, caplog):
    caplog.set_level(logging.INFO, logger="clef_gguf.server")
    gated = Gated(clef)
    with ThreadServer(gated) as srv:
        gated.gate.clear()
        first, out = in_background(httpx.post, f"{srv.url}/v1/systemone", json=request_body(1),
                                   timeout=DEADLINE_S)
        wait_for(lambda: gated.entered == 1, "the first request to reach the model")
        sock = _raw_post(srv.port, request_body(2))
        wait_for(lambda: len(srv.queue.waiting_jobs()) == 1, "the second request to queue")
        (job,) = srv.queue.waiting_jobs()
        sock.close()
        wait_for(lambda: job.abandoned, "the server to notice the disconnect")
        gated.gate.set()
        first.join(DEADLINE_S)
        assert out[0].status_code == 200
        assert httpx.post(f"{srv.url}/v1/systemone", json=request_body(3),
                          timeout=DEADLINE_S).status_code == 200
        assert gated.entered == 2  # the first and the third; the abandoned one never ran
    assert "status=499" in caplog.text


def test_client_gone_while_running_is_discarded(clef, caplog):
    caplog.set_level(logging.INFO, logger="clef_gguf.server")
    gated = Gated(clef)
    with ThreadServer(gated) as srv:
        gated.gate.clear()
        sock = _raw_post(srv.port, request_body(1))
        wait_for(lambda: gated.entered == 1, "the request to reach the model")
        sock.close()
        wait_for(lambda: "status=499" in caplog.text, "the server to log the disconnect")
        gated.gate.set()
        wait_for(lambda: not srv.queue.busy, "the worker to finish the abandoned pass")
        response = httpx.post(f"{srv.url}/v1/systemone", json=request_body(1), timeout=DEADLINE_S)
        assert response.status_code == 200 and gated.runs == 2


def test_shutdown_lets_the_request_in_flight_finish(clef):
    gated = Gated(clef)
    srv = ThreadServer(gated).__enter__()
    gated.gate.clear()
    flight, out = in_background(httpx.post, f"{srv.url}/v1/systemone", json=request_body(4),
                                timeout=DEADLINE_S)
    wait_for(lambda: gated.entered == 1, "the request to reach the model")
    srv.server.should_exit = True  # what SIGINT / SIGTERM do
    wait_for(lambda: not srv.server.servers or all(not s.is_serving() for s in
                                                   srv.server.servers), "listeners to close")
    gated.gate.set()
    flight.join(DEADLINE_S)
    srv.stop()
    assert out[0].status_code == 200 and out[0].json()["answers"]
    executor = srv.queue._executor
    assert executor is not None and not any(t.is_alive() for t in executor._threads)
