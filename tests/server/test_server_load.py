"""The server as a process under load, overload and signals, on the tiny model.

* 32 concurrent clients x 10 requests: every request answered, none lost, no 5xx, every body
  byte-identical to the sequential run's.
* A burst beyond a small queue: exact 429s with Retry-After (the model is held, so the count is
  exact), then recovery; and an unheld burst against a ``--queue-size 1`` process.
* SIGTERM / SIGINT: exit code 0 and the port released; a model that cannot load: exit code 1.
"""

import json
import re
import signal
import threading

import httpx
import pytest

from clef_gguf import Clef
from server_helpers import (DEADLINE_S, Gated, ThreadServer, port_is_free, request_body,
                            serve_process, server_log, wait_for, wait_healthy)

CLIENTS, PER_CLIENT, DISTINCT = 32, 10, 16
# One tower thread and one torch thread: llama.cpp's OpenMP threads and torch's spin while they
# wait, and on a 2-core runner the two pools (plus the 32 client threads here) starve each other:
# the tiny model's pass then takes ~500 ms instead of ~20 ms. The server code is the same.
MODEL_ARGS = ("--threads", "1", "--max-length", "2048")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def small_body(i: int) -> bytes:
    """Short requests (the tiny tokenizer makes even the fixed prompt ~250 tokens)."""
    return json.dumps({"state": f"Ticket {i}: refund late by {i} days",
                       "questions": {"urgent": {"type": "noul"},
                                     "team": {"type": "choice",
                                              "criteria": {"billing": "Payments", "tech": None}}}}
                      ).encode()


def _post_all(url: str, bodies: list[bytes], barrier: threading.Barrier | None = None) -> list:
    out = []
    with httpx.Client(base_url=url, timeout=DEADLINE_S) as client:
        if barrier is not None:
            barrier.wait(DEADLINE_S)
        for body in bodies:
            try:
                response = client.post("/v1/systemone", content=body)
                out.append((response.status_code, response.content, response.headers))
            except httpx.HTTPError as exc:  # counted as lost below
                out.append((None, repr(exc).encode(), {}))
    return out


def _run_clients(url: str, plans: list[list[bytes]]) -> list[list]:
    results: list[list] = [[] for _ in plans]
    barrier = threading.Barrier(len(plans))

    def client(i: int) -> None:
        results[i] = _post_all(url, plans[i], barrier)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S * 4)
    assert not any(t.is_alive() for t in threads), "a client never got its answers"
    return results


def _log_statuses(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"POST /v1/systemone status=(\d+)", text)]


@pytest.mark.slow
def test_32_clients_x_10_requests_none_lost_all_identical(tiny_model_dir, tmp_path):
    bodies = [small_body(i) for i in range(DISTINCT)]
    with serve_process(tmp_path, "--model", str(tiny_model_dir), *MODEL_ARGS,
                       env=ONE_THREAD) as (proc, url, _):
        wait_healthy(proc, url)
        sequential = _post_all(url, bodies)
        assert [s for s, _, _ in sequential] == [200] * DISTINCT
        baseline = [content for _, content, _ in sequential]
        assert len(set(baseline)) == DISTINCT  # the inputs really differ

        plans = [[bodies[(c * PER_CLIENT + k) % DISTINCT] for k in range(PER_CLIENT)]
                 for c in range(CLIENTS)]
        results = _run_clients(url, plans)
        answered = sum(len(r) for r in results)
        statuses = [s for r in results for s, _, _ in r]
        assert answered == CLIENTS * PER_CLIENT
        assert statuses == [200] * (CLIENTS * PER_CLIENT), "lost, refused or failed requests"
        for c, r in enumerate(results):
            for k, (_, content, _) in enumerate(r):
                assert content == baseline[(c * PER_CLIENT + k) % DISTINCT]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE_S) == 0
    # The server's side of the count: one log line per request, all 200.
    logged = _log_statuses(server_log(proc))
    assert logged == [200] * (DISTINCT + CLIENTS * PER_CLIENT)


def test_burst_beyond_the_queue_gets_exact_429s_then_recovers(tiny_model_dir):
    burst = 10
    with Clef.load(tiny_model_dir, max_length=2048, threads=2) as clef:
        gated = Gated(clef)
        with ThreadServer(gated, queue_size=2) as srv:
            gated.gate.clear()
            body = small_body(1)
            holder: list = []
            first = threading.Thread(target=lambda: holder.extend(_post_all(srv.url, [body])))
            first.start()
            wait_for(lambda: gated.entered == 1, "the first request to reach the model")
            results: list = []
            lock = threading.Lock()

            def one() -> None:
                got = _post_all(srv.url, [body])
                with lock:
                    results.extend(got)

            threads = [threading.Thread(target=one, daemon=True) for _ in range(burst)]
            for t in threads:
                t.start()
            # 2 wait in the queue; the other 8 are refused at once, while the model is held.
            wait_for(lambda: len(results) == burst - 2, "the refusals")
            assert len(srv.queue.waiting_jobs()) == 2
            for status, content, headers in results:
                assert status == 429 and json.loads(content)["error"]["code"] == "queue_full"
                assert int(headers["retry-after"]) >= 1
            gated.gate.set()
            for t in [first, *threads]:
                t.join(DEADLINE_S)
            assert [s for s, _, _ in holder + results[burst - 2:]] == [200] * 3
            assert len({c for _, c, _ in holder + results[burst - 2:]}) == 1
            assert gated.runs == 3
            again = _post_all(srv.url, [body] * 5)
            assert [s for s, _, _ in again] == [200] * 5  # recovered


def test_unheld_burst_on_a_tiny_queue_only_429s_and_recovers(tiny_model_dir, tmp_path):
    with serve_process(tmp_path, "--model", str(tiny_model_dir), *MODEL_ARGS,
                       "--queue-size", "1", env=ONE_THREAD) as (proc, url, _port):
        wait_healthy(proc, url)
        body = small_body(3)
        results = [x for r in _run_clients(url, [[body] * 3 for _ in range(24)]) for x in r]
        assert len(results) == 72
        ok = {c for s, c, _ in results if s == 200}
        refused = [(c, h) for s, c, h in results if s == 429]
        assert len(ok) == 1  # every answer is the same bytes
        assert sum(1 for s, _, _ in results if s not in (200, 429)) == 0
        for content, headers in refused:
            assert json.loads(content)["error"]["code"] == "queue_full"
            assert int(headers["retry-after"]) >= 1
        after = _post_all(url, [body] * 3)
        assert [s for s, _, _ in after] == [200] * 3 and {c for _, c, _ in after} == ok
        proc.send_signal(signal.SIGINT)
        assert proc.wait(DEADLINE_S) == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_and_releases_the_port(tiny_model_dir, tmp_path, sig):
    with serve_process(tmp_path, "--model", str(tiny_model_dir), *MODEL_ARGS,
                       env={"CLEF_GGUF_API_KEY": "k3y"}) as (proc, url, port):
        wait_healthy(proc, url)  # /health needs no key
        assert httpx.post(f"{url}/v1/systemone", json=request_body()).status_code == 401
        ok = httpx.post(f"{url}/v1/systemone", json=request_body(),
                        headers={"Authorization": "Bearer k3y"}, timeout=DEADLINE_S)
        assert ok.status_code == 200
        proc.send_signal(sig)
        assert proc.wait(DEADLINE_S) == 0
        assert port_is_free(port)
        assert f"stopped ({sig.name})" in server_log(proc)


def test_sigterm_while_the_model_loads_exits_0(tiny_model_dir, tmp_path):
    """Stopped as soon as the port answers (usually still ``loading``): no abort at exit."""
    with serve_process(tmp_path, "--model", str(tiny_model_dir), *MODEL_ARGS) as (proc, url, _):
        def answering() -> bool:
            assert proc.poll() is None, server_log(proc)
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code in (200, 503)
            except httpx.TransportError:
                return False

        wait_for(answering, "the port to answer")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE_S) == 0, server_log(proc)


def test_a_model_that_cannot_load_exits_1(tmp_path):
    with serve_process(tmp_path, "--model", str(tmp_path / "missing-model")) as (proc, _url, port):
        assert proc.wait(DEADLINE_S) == 1
        assert "model_not_found" in server_log(proc)
        assert port_is_free(port)
