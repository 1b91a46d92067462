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
