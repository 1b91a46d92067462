"""The server as a process under load, overload and signals, on the tiny model.

* 64 concurrent clients x 20 requests, mixed (valid, batches, invalid, oversized bodies, prompts
  too long, clients leaving mid-body or before the answer) against a small queue: none lost, no
  5xx (answered or logged), every answer byte-identical to the sequential run's, every 429 a
  ``queue_full`` with Retry-After (the client then retries). Figures printed (``-s``).
* A burst beyond a small queue: exact 429s with Retry-After (the model is held, so the count is
  exact), then recovery; and an unheld burst against a ``--queue-size 1`` process.
* SIGTERM / SIGINT: exit code 0 and the port released; a model that cannot load: exit code 1.
* ``--drain-timeout``: a request inside the model at SIGTERM finishes (same bytes) and the
  process exits 0; past the timeout it is answered 503 ``shutting_down``, still exit 0.
"""

import collections
import json
import re
import signal
import socket
import statistics
import threading
import time

import httpx
import pytest

from clef_gguf import Clef
from server_helpers import (same, DEADLINE_S, GATED_SERVE, Gated, ThreadServer, port_is_free,
                            request_body, serve_process, server_log, wait_for, wait_healthy,
                            wait_process_ready)

CLIENTS, PER_CLIENT, DISTINCT = 64, 20, 16
MAX_BODY = 64 * 1024
RETRY_PAUSE_S = 0.1  # not Retry-After itself (whole seconds): the test only needs the retry
MAX_ATTEMPTS = 400
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


def _mixed_bodies() -> dict[str, list[bytes]]:
    """Every kind of request the load mixes, a few distinct bodies of each."""
    batch = [json.dumps({"state": [{"id": f"b{i}", "text": f"Ticket {i} is late"},
                                   {"id": "x", "text": "t", "questions": {"q": {"type": "?"}}}],
                         "questions": {"urgent": {"type": "noul"}}}).encode() for i in range(2)]
    invalid = [b"{not json", b'{"questions": {"q": {"type": "noul"}}}',
               b'{"state": 1, "questions": {"q": {"type": "maybe"}}}', b"[]",
               b'{"state": 1, "questions": {}}']
    oversized = [json.dumps({"state": "x" * (MAX_BODY + 1000),
                             "questions": {"q": {"type": "noul"}}}).encode()]
    too_long = [json.dumps({"state": "word " * 6000, "questions": {"q": {"type": "noul"}}})
                .encode()]
    return {"valid": [small_body(i) for i in range(DISTINCT)], "batch": batch,
            "invalid": invalid, "oversized": oversized, "too_long": too_long}


# Per 20 requests of a client: 11 valid, 1 batch, 2 invalid, 1 oversized body, 1 prompt too
# long, 2 leave mid-body, 2 leave before the answer.
MIX = (["valid"] * 11 + ["batch", "invalid", "invalid", "oversized", "too_long"]
       + ["gone_mid_body"] * 2 + ["gone_after_send"] * 2)


def _leave(port: int, body: bytes, mid_body: bool) -> None:
    """A client that sends (half) a request and closes the connection without reading."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % (port, len(body)))
        sock.sendall(body[:len(body) // 2] if mid_body else body)


def _mixed_client(url: str, port: int, plan: list[tuple[str, bytes]],
                  barrier: threading.Barrier) -> list[dict]:
    out = []
    with httpx.Client(base_url=url, timeout=DEADLINE_S) as client:
        barrier.wait(DEADLINE_S)
        for kind, body in plan:
            if kind.startswith("gone"):
                _leave(port, body, kind == "gone_mid_body")
                out.append({"kind": kind, "attempts": 1})
                continue
            record = {"kind": kind, "body": body, "refusals": [], "latency": []}
            for _ in range(MAX_ATTEMPTS):
                started = time.perf_counter()
                try:
                    response = client.post("/v1/systemone", content=body)
                except httpx.HTTPError as exc:  # a lost request: failed below
                    record["status"], record["content"] = None, repr(exc).encode()
                    break
                record["latency"].append(time.perf_counter() - started)
                record["status"], record["content"] = response.status_code, response.content
                if response.status_code != 429:
                    break
                record["refusals"].append((response.content,
                                           response.headers.get("retry-after")))
                time.sleep(RETRY_PAUSE_S)
            record["attempts"] = len(record["latency"])
            out.append(record)
    return out


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 \
        else values[0]


@pytest.mark.slow
def test_64_clients_x_20_mixed_requests_none_lost_all_identical(tiny_model_dir, tmp_path):
    bodies = _mixed_bodies()
    with serve_process(tmp_path, "--model", str(tiny_model_dir), *MODEL_ARGS,
                       "--queue-size", "16", "--max-body-bytes", str(MAX_BODY),
                       env=ONE_THREAD) as (proc, url, port):
        wait_healthy(proc, url)
        with httpx.Client(base_url=url, timeout=DEADLINE_S) as client:
            # Twice: the second run's answers are the warm caches' (usage.cached_tokens), as
            # every answer under load is.
            for _ in range(2):
                sequential = {b: client.post("/v1/systemone", content=b)
                              for group in bodies.values() for b in group}
        baseline = {b: (r.status_code, r.content) for b, r in sequential.items()}
        assert {baseline[b][0] for b in bodies["valid"] + bodies["batch"]} == {200}
        assert len({baseline[b][1] for b in bodies["valid"]}) == DISTINCT  # inputs differ
        assert {baseline[b][0] for b in bodies["invalid"]} == {422}
        assert [json.loads(baseline[b][1])["error"]["code"] for b in
                bodies["oversized"] + bodies["too_long"]] == ["body_too_large",
                                                               "context_too_large"]

        def body_for(kind: str, n: int) -> bytes:
            group = bodies["valid" if kind.startswith("gone") else kind]
            return group[n % len(group)]

        plans = [[(MIX[(c + k) % len(MIX)], body_for(MIX[(c + k) % len(MIX)], c * 7 + k))
                  for k in range(PER_CLIENT)] for c in range(CLIENTS)]
        barrier = threading.Barrier(CLIENTS)
        results: list[list] = [[] for _ in plans]
        started = time.perf_counter()

        def run(c: int) -> None:
            results[c] = _mixed_client(url, port, plans[c], barrier)

        threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S * 10)
        wall = time.perf_counter() - started
        assert not any(t.is_alive() for t in threads), "a client never got its answers"
        records = [r for rs in results for r in rs]
        assert len(records) == CLIENTS * PER_CLIENT
        answered = [r for r in records if not r["kind"].startswith("gone")]
        lost = [r for r in answered if r["status"] is None]
        assert not lost, lost[0]["content"]
        for r in answered:  # the final answer of each: the sequential run's bytes exactly
            assert (r["status"], r["content"]) == baseline[r["body"]], r["kind"]
        refusals = [x for r in answered for x in r["refusals"]]
        for content, retry_after in refusals:
            assert json.loads(content)["error"]["code"] == "queue_full"
            assert retry_after is not None and int(retry_after) >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE_S) == 0
    logged = collections.Counter(_log_statuses(server_log(proc)))
    exchanges = 2 * len(baseline) + sum(r["attempts"] for r in records)
    latencies = [x for r in answered for x in r["latency"]]
    by_kind = collections.Counter((r["kind"], r.get("status")) for r in records)
    print(f"\nload: {CLIENTS} clients x {PER_CLIENT} requests = {len(records)} in {wall:.1f} s; "
          f"{exchanges} HTTP exchanges incl. {len(refusals)} 429 retries and the "
          f"2 x {len(baseline)} sequential requests")
    print(f"load: final statuses by kind {dict(sorted(by_kind.items(), key=str))}")
    print(f"load: server log statuses {dict(sorted(logged.items()))}")
    print(f"load: latency per exchange p50 {_percentile(latencies, 50) * 1e3:.0f} ms, "
          f"p95 {_percentile(latencies, 95) * 1e3:.0f} ms (n={len(latencies)})")
    assert sum(logged.values()) == exchanges, "the server missed a request"
    assert not [s for s in logged if s >= 500], logged
    gone = sum(1 for r in records if r["kind"].startswith("gone"))
    assert logged[499] <= gone and logged[429] >= len(refusals)


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
            assert len({json.dumps(same(c)) for _, c, _ in holder + results[burst - 2:]}) == 1
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
        ok = {json.dumps(same(c)) for s, c, _ in results if s == 200}
        refused = [(c, h) for s, c, h in results if s == 429]
        assert len(ok) == 1  # every answer is the same bytes
        assert sum(1 for s, _, _ in results if s not in (200, 429)) == 0
        for content, headers in refused:
            assert json.loads(content)["error"]["code"] == "queue_full"
            assert int(headers["retry-after"]) >= 1
        after = _post_all(url, [body] * 3)
        assert [s for s, _, _ in after] == [200] * 3
        assert {json.dumps(same(c)) for _, c, _ in after} == ok
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


def _held_server(tmp_path, tiny_model_dir, *args: str):
    gate = tmp_path / "gate"
    gate.mkdir()
    return gate, serve_process(tmp_path, "--model", str(tiny_model_dir), *MODEL_ARGS, *args,
                               env=ONE_THREAD, entry=(*GATED_SERVE, str(gate)))


def _post_in_background(url: str, body: bytes) -> tuple[threading.Thread, list]:
    out: list = []

    def post() -> None:
        try:
            out.append(httpx.post(f"{url}/v1/systemone", content=body, timeout=DEADLINE_S * 2))
        except httpx.HTTPError as exc:
            out.append(exc)

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread, out


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_lets_the_request_in_the_model_finish_then_exits_0(tiny_model_dir, tmp_path):
    gate, server = _held_server(tmp_path, tiny_model_dir, "--drain-timeout", "120")
    with server as (proc, url, port):
        (gate / "release").touch()
        wait_healthy(proc, url)
        body = small_body(5)
        for _ in range(2):  # the second answer is the warm caches', as the held one will be
            before = httpx.post(f"{url}/v1/systemone", content=body, timeout=DEADLINE_S)
            assert before.status_code == 200
        (gate / "release").unlink()
        flight, out = _post_in_background(url, body)
        wait_for(lambda: (gate / "entered-3").exists(), "the request to reach the model")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "Waiting for connections to close" in server_log(proc),
                 "the server to start draining")
        wait_for(lambda: _refused(port), "the listener to close")
        assert proc.poll() is None and not out  # still draining, the request still held
        (gate / "release").touch()
        flight.join(DEADLINE_S)
        assert proc.wait(DEADLINE_S) == 0, server_log(proc)
    assert out[0].status_code == 200 and out[0].content == before.content
    assert "stopped (SIGTERM)" in server_log(proc)


def test_past_the_drain_timeout_the_request_gets_503_and_the_exit_is_0(tiny_model_dir,
                                                                       tmp_path):
    gate, server = _held_server(tmp_path, tiny_model_dir, "--drain-timeout", "0.5")
    with server as (proc, url, _port):
        wait_healthy(proc, url)
        flight, out = _post_in_background(url, small_body(6))
        wait_for(lambda: (gate / "entered-1").exists(), "the request to reach the model")
        proc.send_signal(signal.SIGTERM)
        # Answered while the pass is still held: the drain ran out, not the model.
        flight.join(DEADLINE_S)
        assert out and out[0].status_code == 503, out
        assert out[0].json() == {"error": {
            "code": "shutting_down", "field": None,
            "message": "the server stopped before this request was answered "
                       "(--drain-timeout ran out)"}}
        assert proc.poll() is None  # waits for the pass inside llama.cpp before exiting
        (gate / "release").touch()
        assert proc.wait(DEADLINE_S) == 0, server_log(proc)
    log = server_log(proc)
    assert "timeout graceful shutdown exceeded" in log and "Traceback" not in log
    assert "status=503" in log and "stopped (SIGTERM)" in log


def test_sigterm_while_the_model_loads_exits_0(tiny_model_dir, tmp_path):
    """Stopped as soon as the port answers (usually still ``loading``): no abort at exit."""
    with serve_process(tmp_path, "--model", str(tiny_model_dir), *MODEL_ARGS) as (proc, url, _):
        def answering() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code in (200, 503)
            except httpx.TransportError:
                return False

        wait_process_ready(proc, answering, "the port to answer")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE_S) == 0, server_log(proc)


def test_a_model_that_cannot_load_exits_1(tmp_path):
    with serve_process(tmp_path, "--model", str(tmp_path / "missing-model")) as (proc, _url, port):
        assert proc.wait(DEADLINE_S) == 1
        assert "model_not_found" in server_log(proc)
        assert port_is_free(port)


@pytest.mark.parametrize("command", [("serve",), ("ui", "--no-browser"), ("serve", "--engine", "ray-serve")])
def test_a_taken_port_is_refused_before_any_model_loads(tmp_path, command):
    """Another process listens on the port: the command exits 1 naming the address, and never loads the
    model (a directory that holds none would otherwise be the error); the other process keeps its port."""
    import subprocess
    import sys

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        done = subprocess.run([sys.executable, "-c", "import sys; from clef_gguf.cli import main; sys.exit(main())",
                               *command, "--model", str(tmp_path / "no-model-here"), "--port", str(port)],
                              capture_output=True, text=True, timeout=DEADLINE_S)
        assert done.returncode == 1, done.stderr
        error = json.loads(done.stdout.splitlines()[-1])["error"]
        assert error == {"code": "address_unavailable", "field": "port", "message":
                         f"127.0.0.1:{port} is in use (another server listens there: stop it or choose another "
                         "--port)"}
        assert "model_not_found" not in done.stdout + done.stderr


def test_an_address_not_of_this_machine_is_refused_naming_the_host():
    from clef_gguf.core.errors import AddressUnavailable
    from clef_gguf.server.http import listen

    with pytest.raises(AddressUnavailable) as caught:
        listen("192.0.2.1", 8080)  # TEST-NET-1: never this machine's
    assert caught.value.field == "host" and caught.value.message.startswith("192.0.2.1:8080 is not an address")
    with pytest.raises(AddressUnavailable, match="does not resolve"):
        listen("no-such-host.invalid", 8080)
    with listen("127.0.0.1", 0) as sock:  # port 0: a free one, chosen by the system (what `ui` binds)
        assert sock.getsockname()[1] > 0
