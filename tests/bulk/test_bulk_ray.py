"""The Ray engines on a private local Ray (2 CPUs): the batch job on 2 actors writes what the
local engine writes, byte for byte; 2 Ray Serve replicas answer like ``serve``."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import httpx
import psutil

from bulk_helpers import OTHER, SCHEMA, run_batch, state, write_schema, write_states
from clef_gguf.runtime.model import Clef

# the server tests' helpers (a real uvicorn server, a serve child process): on the path when
# tests/server is collected too, and by this line when tests/bulk runs alone
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import ThreadServer, serve_process, wait_healthy  # noqa: E402



def test_ray_batch_with_two_actors_equals_the_local_engine(tiny_model_dir, tmp_path):
    src = write_states(tmp_path / "in.jsonl", 40, bad_at=(13,))
    schema = write_schema(tmp_path / "q.json")
    common = ("-i", str(src), "-q", str(schema), "--window", "5")
    local = run_batch(tiny_model_dir, *common, "-o", str(tmp_path / "local.jsonl"))
    assert local.returncode == 0, local.stderr
    started = time.monotonic()
    ray = run_batch(tiny_model_dir, *common, "-o", str(tmp_path / "ray.jsonl"), "--engine", "ray",
                    "--replicas", "2", "--threads-per-replica", "1", timeout=300)
    print(f"\nRay batch, 2 actors: {time.monotonic() - started:.1f} s\n{ray.stderr[-400:]}")
    assert ray.returncode == 0, ray.stderr
    assert (tmp_path / "ray.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()
    assert "39 answered, 1 failed (invalid_json: 1)" in ray.stderr


def _requests() -> list[tuple[str, bytes]]:
    single = [json.dumps({"state": state(i), "questions": SCHEMA if i % 2 else OTHER}).encode()
              for i in range(8)]
    batch = json.dumps({"state": [{"id": f"s{i}", "text": state(i)} for i in range(3)],
                        "questions": SCHEMA}).encode()
    too_long = json.dumps({"state": "word " * 3000, "questions": OTHER}).encode()
    return ([("/v1/systemone", body) for body in single + single[:2]]  # repeats: cache hits
            + [("/v1/systemone/batch", batch), ("/v1/systemone", b"{oops"),
               ("/v1/systemone", too_long)])


def _without_cached_tokens(body: bytes) -> bytes:
    """``usage.cached_tokens`` says what a replica's cache held, not what was asked."""
    obj = json.loads(body)
    for item in [obj, *obj.get("results", [])]:
        if isinstance(item, dict):
            item.get("usage", {}).pop("cached_tokens", None)
    return json.dumps(obj).encode()


def test_ray_serve_replicas_answer_like_serve(tiny_model_dir, tmp_path):
    flags = ("--model", str(tiny_model_dir), "--max-length", "2048")
    with Clef.load(tiny_model_dir, threads=1, max_length=2048) as clef, ThreadServer(clef) as ref:
        expected = [httpx.post(ref.url + path, content=body, timeout=60) for path, body in
                    _requests()]
    started = time.monotonic()
    with serve_process(tmp_path, *flags, "--engine", "ray-serve", "--replicas", "2",
                       "--threads", "1") as (proc, url, _port):
        wait_healthy(proc, url)
        print(f"\nRay Serve, 2 replicas healthy after {time.monotonic() - started:.1f} s")
        health = httpx.get(url + "/health", timeout=30)
        assert health.json()["status"] == "ok"
        for (path, body), want in zip(_requests(), expected):
            got = httpx.post(url + path, content=body, timeout=60)
            assert got.status_code == want.status_code, (path, got.text)
            assert _without_cached_tokens(got.content) == _without_cached_tokens(want.content)
            if b"cached_tokens" not in got.content + want.content:
                assert got.content == want.content  # byte-identical
        family = psutil.Process(proc.pid).children(recursive=True)  # Ray's own processes
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        _gone, alive = psutil.wait_procs(family, timeout=60)
        assert not alive, f"Ray processes left behind: {[p.pid for p in alive]}"



QUESTION_SETS = [{"urgent": {"type": "noul"}}, SCHEMA, OTHER,
                 {"team": {"type": "choice", "criteria": {"billing": None, "shipping": None, "returns": None}}}]


def _post_all(url: str, requests: list[dict], clients: int) -> list[httpx.Response]:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda body: httpx.post(url + "/v1/systemone", json=body, timeout=300), requests))


def _metric(url: str, name: str) -> dict[tuple, float]:
    """Each sample of ``name`` in the ingress's /metrics, by its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_ray_serve_routes_each_state_to_its_replica_and_loses_no_request_when_one_dies(tiny_model_dir, tmp_path):
    """10 states each asked 4 question sets, shuffled, 4 clients at once, 2 replicas: a repeated state
    meets its replica's state cache (its cached tokens past the system prefix) at least 27 times in 30,
    with the answers of one process. Then one replica's process is killed while 24 requests are in
    flight: every one is answered, as one process answers it, and the routers say they sent some again."""
    import random

    flags = ("--model", str(tiny_model_dir), "--max-length", "2048")
    states = [f"Ticket {n}: customer {n} wrote twice about parcel {1000 + n}, which never came. " * 8
              for n in range(10)]
    asked = [{"state": states[s], "questions": QUESTION_SETS[q]} for s in range(10) for q in range(4)]
    random.Random(0).shuffle(asked)
    long_states = [{"state": f"Case {n}: " + "the parcel was late and the box was damaged. " * 64,
                    "questions": SCHEMA} for n in range(24)]
    with Clef.load(tiny_model_dir, threads=1, max_length=2048) as clef:
        prefix = clef.prepare(asked[0]).encoded.prefix_tokens
        want = [clef.decide(body)["answers"] for body in asked]
        want_long = [clef.decide(body)["answers"] for body in long_states]
    with serve_process(tmp_path, *flags, "--engine", "ray-serve", "--replicas", "2",
                       "--threads", "1") as (proc, url, _port):
        wait_healthy(proc, url)
        deadline = time.monotonic() + 120
        while len(_metric(url, "clef_replica_info")) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)  # both replicas up (one answering is enough for /health): keys spread over both
        got = _post_all(url, asked, clients=4)
        assert [g.status_code for g in got] == [200] * 40
        assert [g.json()["answers"] for g in got] == want
        seen: set[str] = set()
        repeats = hits = 0
        for body, answer in zip(asked, got):
            if body["state"] in seen:
                repeats += 1
                hits += answer.json()["usage"]["cached_tokens"] > prefix
            seen.add(body["state"])
        print(f"\nstate routing: {hits} of {repeats} repeated states found in their replica's cache")
        assert repeats == 30 and hits >= 27
        deadline = time.monotonic() + 30
        while sum(_metric(url, "clef_decisions_total").values()) < 40 and time.monotonic() < deadline:
            time.sleep(0.5)  # the replicas' stats reach the routers every second
        assert sum(_metric(url, "clef_decisions_total").values()) == 40
        assert _metric(url, "clef_routing_total")[(("choice", "affinity"),)] >= 27
        pids = [int(dict(labels)["pid"]) for labels in _metric(url, "clef_replica_info")]
        assert len(pids) == 2

        import concurrent.futures
        import os

        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            flight = pool.submit(_post_all, url, long_states, 24)
            time.sleep(1.0)
            os.kill(pids[0], signal.SIGKILL)
            answered = flight.result()
        assert [a.status_code for a in answered] == [200] * 24, [a.text for a in answered if a.status_code != 200]
        assert [a.json()["answers"] for a in answered] == want_long
        assert _metric(url, "clef_routing_total").get((("choice", "retried"),), 0) >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
