"""Hardening of the server on the tiny model, against real uvicorn servers on 127.0.0.1:

* tokenizing is bounded: at most ``tokenize_workers`` prepares at once, at most ``queue_size``
  requests waiting for one, the rest refused at once with 429 + Retry-After;
* a batch input that fails with any exception fails alone (``internal_error`` in its result);
* a fault inside the tower (RuntimeError, or llama_decode failing -> InferenceError) fails only
  its request with an API-shaped 5xx, and the next answers are byte-identical to before;
* the ``serve`` flags that bound this are validated.

Where a state matters it is reached exactly: prepares are held on a semaphore and released one
at a time, so no assertion depends on timing.
"""

import argparse
import json
import logging
import socket
import threading

import httpx
import pytest

import clef_gguf.tower.llama as tower_module  # the llama.cpp bindings: its ll is llama_cpp
from clef_gguf import Clef
from clef_gguf.server import app as server_app
from server_helpers import raw_post, same, DEADLINE_S, Gated, ThreadServer, request_body, wait_for


@pytest.fixture(scope="module")
def clef(tiny_model_dir):
    with Clef.load(tiny_model_dir, max_length=2048, threads=2) as model:
        yield model


def api_error(response: httpx.Response) -> dict:
    """The error object, after checking the body is exactly the API's error shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"code", "message", "field"}, err
    assert isinstance(err["code"], str) and isinstance(err["message"], str) and err["message"]
    assert err["field"] is None or isinstance(err["field"], str)
    return err


class HeldPrepare(Gated):
    """Each ``prepare`` waits for one ``release()`` and records how many ran at once."""

    def __init__(self, clef) -> None:
        super().__init__(clef)
        self.permits = threading.Semaphore(0)
        self.inside = self.peak = self.prepares = 0

    def prepare(self, *args, **kwargs):
        with self._lock:
            self.inside += 1
            self.prepares += 1
            self.peak = max(self.peak, self.inside)
        try:
            assert self.permits.acquire(timeout=DEADLINE_S), "never released"
            return self.clef.prepare(*args, **kwargs)
        finally:
            with self._lock:
                self.inside -= 1

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.release()


def _post_in_background(url: str, bodies: list, out: list) -> list[threading.Thread]:
    def one(body) -> None:
        try:
            response = httpx.post(f"{url}/v1/systemone", content=body, timeout=DEADLINE_S)
            out.append((response.status_code, response.content, response.headers))
        except httpx.HTTPError as exc:  # a lost request: fails the status checks below
            out.append((None, repr(exc).encode(), {}))

    threads = [threading.Thread(target=one, args=(b,), daemon=True) for b in bodies]
    for t in threads:
        t.start()
    return threads


# ------------------------------------------------------------------ tokenization is bounded
def test_at_most_n_prepares_at_once_and_the_overflow_gets_429(clef):
    workers, waiting, burst = 2, 3, 12
    held = HeldPrepare(clef)
    with ThreadServer(held, queue_size=waiting, tokenize_workers=workers) as srv:
        stage = srv.app.state.prepare_stage
        body = json.dumps(request_body(1)).encode()
        held.release()
        warm = httpx.post(f"{srv.url}/v1/systemone", content=body, timeout=DEADLINE_S)
        assert warm.status_code == 200  # later answers of the same body come from warm caches
        out: list = []
        threads = _post_in_background(srv.url, [body] * (workers + waiting), out)
        wait_for(lambda: stage.pending == workers + waiting and held.inside == workers,
                 "two prepares held and three requests waiting for them")
        # One large body among the overflow: refused before it is read, yet answered cleanly.
        big = json.dumps(request_body(2, model="m" * 1_000_000)).encode()
        refused: list = []
        overflow = burst - workers - waiting
        threads += _post_in_background(srv.url, [body] * (overflow - 1) + [big], refused)
        wait_for(lambda: len(refused) == overflow, "the overflow to be refused")
        assert stage.pending == workers + waiting and stage.running == workers and not out
        for status, content, headers in refused:
            assert status == 429, content
            assert int(headers["retry-after"]) >= 1
            assert api_error(httpx.Response(429, content=content))["code"] == "queue_full"
        # Release one prepare at a time: each answer comes back before the next is let in, so
        # the model's queue never fills and every admitted request must be answered.
        for k in range(workers + waiting):
            held.release()
            wait_for(lambda k=k: len(out) == k + 1, "the released request's answer")
        for t in threads:
            t.join(DEADLINE_S)
        answered = out
        assert [s for s, _, _ in answered] == [200] * (workers + waiting)
        assert len({c for _, c, _ in answered}) == 1  # the same request, the same bytes
        assert held.peak == workers and held.prepares == 1 + workers + waiting
        assert stage.pending == 0 and stage.running == 0
        held.release(3)
        again: list = []
        for t in _post_in_background(srv.url, [body] * 3, again):
            t.join(DEADLINE_S)
        assert [s for s, _, _ in again] == [200] * 3  # recovered


def test_a_client_gone_while_waiting_for_a_tokenizer_is_not_tokenized(clef, caplog):
    caplog.set_level(logging.INFO, logger="clef_gguf.server")
    held = HeldPrepare(clef)
    with ThreadServer(held, tokenize_workers=1) as srv:
        stage = srv.app.state.prepare_stage
        out: list = []
        (first,) = _post_in_background(srv.url, [json.dumps(request_body(1)).encode()], out)
        wait_for(lambda: held.inside == 1, "the first prepare to start")
        sock = raw_post(srv.port, json.dumps(request_body(2)).encode())
        wait_for(lambda: stage.pending == 2, "the second request to wait for the tokenizer")
        sock.close()
        held.release()
        first.join(DEADLINE_S)
        assert out[0][0] == 200
        wait_for(lambda: "status=499" in caplog.text, "the server to drop the gone client")
        assert held.prepares == 1 and stage.pending == 0


def test_a_client_gone_mid_body_is_a_499_not_a_server_error(clef, caplog):
    caplog.set_level(logging.INFO, logger="clef_gguf.server")
    with ThreadServer(Gated(clef)) as srv:
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: 5000\r\n\r\n"
                     b'{"state": "half a body' % srv.port)
        wait_for(lambda: srv.app.state.prepare_stage.pending == 1, "the body to be read")
        sock.close()
        wait_for(lambda: "status=499" in caplog.text, "the server to log the disconnect")
        assert "internal_error" not in caplog.text and "Traceback" not in caplog.text
        assert srv.app.state.prepare_stage.pending == 0
        ok = httpx.post(f"{srv.url}/v1/systemone", json=request_body(1), timeout=DEADLINE_S)
        assert ok.status_code == 200


# ------------------------------------------------------------------ batch inputs fail alone
class Flaky(Gated):
    """``prepare`` raises ValueError on state "bad-prepare", ``run`` RuntimeError on "bad-run"."""

    def prepare(self, request, *args, **kwargs):
        if isinstance(request, dict) and request.get("state") == "bad-prepare":
            raise ValueError("tokenizer exploded")
        return super().prepare(request, *args, **kwargs)

    def run(self, prepared):
        if prepared.request.state == "bad-run":
            raise RuntimeError("tower exploded")
        return super().run(prepared)


def test_a_batch_input_failing_outside_clef_error_fails_alone(clef):
    inputs = [{"id": "ok-1", "text": "Refund late"}, {"id": "run", "text": "bad-run"},
              {"id": "prep", "text": "bad-prepare"},
              {"id": "typo", "text": "x", "questions": {"q": {"type": "nope"}}},
              {"id": "ok-2", "text": {"ticket": "printer on fire"}}]
    questions = {"urgent": {"type": "noul"}}
    with ThreadServer(Flaky(clef)) as srv, httpx.Client(base_url=srv.url,
                                                        timeout=DEADLINE_S) as http:
        for path in ("/v1/systemone", "/v1/systemone/batch"):
            response = http.post(path, json={"state": inputs, "questions": questions})
            assert response.status_code == 200
            results = response.json()["results"]
            assert [r["id"] for r in results] == ["ok-1", "run", "prep", "typo", "ok-2"]
            for i, state in ((0, "Refund late"), (4, {"ticket": "printer on fire"})):
                want = clef.decide({"state": state, "questions": questions})
                assert results[i]["answers"] == want["answers"]
            for i, what in ((1, "RuntimeError: tower exploded"),
                            (2, "ValueError: tokenizer exploded")):
                assert results[i]["error"] == {"code": "internal_error", "message": what,
                                               "field": None}
            assert results[3]["error"]["code"] == "invalid_question_type"
            assert len(response.json()["audit"]["input_tokens"]) == 2
        single = http.post("/v1/systemone", json={"state": "bad-prepare", "questions": questions})
        assert single.status_code == 500 and api_error(single)["code"] == "internal_error"
        after = http.post("/v1/systemone", json=request_body(3))
        assert same(after.json()) == same(clef.decide(request_body(3)))


# ------------------------------------------------------------------ faults inside the tower
class Poisoned(Gated):
    """The real model; while it runs the request whose state is ``POISON``, ``armed`` is set."""

    POISON = "poison pill"

    def __init__(self, clef) -> None:
        super().__init__(clef)
        self.armed = threading.Event()

    def run(self, prepared):
        if prepared.request.state != self.POISON:
            return self.clef.run(prepared)
        self.armed.set()
        try:
            return self.clef.run(prepared)
        finally:
            self.armed.clear()


@pytest.mark.parametrize("fault", ["runtime_error", "llama_decode_fails"])
def test_a_tower_fault_fails_one_request_and_the_server_keeps_answering(tiny_model_dir, clef,
                                                                        monkeypatch, fault):
    """The fault is injected at ``llama_decode``, under every path the tower takes to a hidden
    state (a fresh decode, a restored prefix or state), after a real decode has touched the
    context: a RuntimeError escaping the tower, or llama.cpp's error code -> InferenceError."""
    bodies = [json.dumps(request_body(i)).encode() for i in range(4)]
    fresh = [request_body(100 + i) for i in range(3)]  # never seen before the fault
    poison = {"state": Poisoned.POISON, "questions": {"urgent": {"type": "noul"}}}
    with Clef.load(tiny_model_dir, max_length=2048, threads=2) as own:
        model = Poisoned(own)  # its own model: the tower's caches start cold here
        real_decode = tower_module.ll.llama_decode

        def llama_decode(ctx, batch):
            rc = real_decode(ctx, batch)
            if not model.armed.is_set():
                return rc
            if fault == "runtime_error":
                raise RuntimeError("injected tower fault")
            return -1

        with ThreadServer(model) as srv, httpx.Client(base_url=srv.url,
                                                      timeout=DEADLINE_S) as http:
            warm = [http.post("/v1/systemone", content=b) for b in bodies]
            before = [http.post("/v1/systemone", content=b) for b in bodies]
            assert [r.status_code for r in warm + before] == [200] * 8
            monkeypatch.setattr(tower_module.ll, "llama_decode", llama_decode)
            for _ in range(2):
                failed = http.post("/v1/systemone", json=poison)
                err = api_error(failed)
                assert failed.status_code == 500 and failed.headers["x-request-id"]
                if fault == "runtime_error":
                    assert err == {"code": "internal_error", "field": None,
                                   "message": "RuntimeError: injected tower fault"}
                else:
                    assert err["code"] == "inference_error"
                    assert "llama_decode failed with code -1" in err["message"]
                after = [http.post("/v1/systemone", content=b) for b in bodies]
                assert [r.content for r in after] == [r.content for r in before]
                for body in fresh:  # decoded after the fault: the tower state is sound
                    got = http.post("/v1/systemone", json=body).json()
                    want = clef.decide(body)  # the other model instance, never faulted
                    assert got["answers"] == want["answers"]
                    assert got["usage"]["input_tokens"] == want["usage"]["input_tokens"]
            batch = http.post("/v1/systemone/batch", json={"requests": [
                json.loads(bodies[0]), poison, json.loads(bodies[1])]}).json()
            code = "internal_error" if fault == "runtime_error" else "inference_error"
            assert [r.get("error", {}).get("code") for r in batch["results"]] == \
                [None, code, None]
            assert batch["results"][0]["answers"] == json.loads(before[0].content)["answers"]
            monkeypatch.undo()
            healed = http.post("/v1/systemone", json=poison)
            assert healed.status_code == 200
            assert healed.json()["answers"] == clef.decide(poison)["answers"]


# ------------------------------------------------------------------ flags
def _serve_args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    server_app.add_arguments(parser)
    args = parser.parse_args(["--model", "unused"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_serve_flag_defaults():
    args = _serve_args()
    assert args.tokenize_workers == 2 and args.drain_timeout == 300.0


@pytest.mark.parametrize("flag, value, why", [
    ("--tokenize-workers", "0", "must be at least 1"), ("--drain-timeout", "-1", "must be >= 0"),
    ("--drain-timeout", "nan", "must be >= 0"), ("--queue-size", "0", "must be at least 1"),
    ("--max-body-bytes", "0", "must be at least 1"), ("--max-batch", "0", "must be at least 1")])
def test_serve_refuses_bad_bounds_before_loading(flag, value, why, capsys):
    parser = argparse.ArgumentParser()
    server_app.add_arguments(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--model", "unused", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and why in err
