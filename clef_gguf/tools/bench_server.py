"""``clef-gguf bench-server``: requests/s and p50/p95 latency of ``clef-gguf serve`` at several
client concurrencies.

    clef-gguf bench-server --model ./demo-model              # starts a server on a free port
    clef-gguf bench-server --url http://127.0.0.1:8080       # measures a running one

Each level sends ``--requests`` requests from N client threads (each with its own keep-alive
connection), all started together. Every answer is checked: status 200 and the same bytes as a
sequential warm-up run of the same body, so the numbers never hide lost or wrong answers. The
server logs go to a temporary file (printed on failure).

The started server inherits the environment: on small machines compare the defaults with
``OMP_NUM_THREADS=1 clef-gguf bench-server --model M --threads 1`` (one torch thread for the
head, one llama.cpp thread for the tower; their two spinning thread pools can starve each other).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from clef_gguf.bulk.output import CACHE_USAGE
from clef_gguf.core.argtypes import megabytes, positive_int
from clef_gguf.core.children import module_command
from clef_gguf.core.errors import ClefError
from clef_gguf.server.http import free_port

DISTINCT = 16


def body(i: int) -> bytes:
    return json.dumps({"state": f"Ticket {i}: refund late by {i} days, amount {12.5 * i}",
                       "questions": {"urgent": {"type": "noul", "instructions": "Urgent?"},
                                     "team": {"type": "choice", "instructions": "Which team?",
                                              "criteria": {"billing": "Payments", "tech": None}},
                                     "anger": {"type": "score", "instructions": "How angry?",
                                               "criteria": ["calm", "annoyed", "furious"]}}}
                      ).encode()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def answer_bytes(body: bytes) -> bytes:
    """A response without ``usage.cached_tokens`` (and ``cached_media_tokens``): the fields that
    depend on what was served before (the caches), not on the request."""
    obj = json.loads(body)
    for key in CACHE_USAGE:
        obj.get("usage", {}).pop(key, None)
    return json.dumps(obj, sort_keys=True).encode()


def level(url: str, concurrency: int, total: int, expected: list[bytes]) -> dict:
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(concurrency + 1)
    per_client = [list(range(c, total, concurrency)) for c in range(concurrency)]

    def client(indices: list[int]) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            barrier.wait()
            for i in indices:
                t0 = time.perf_counter()
                try:
                    r = http.post("/v1/systemone", content=body(i % DISTINCT))
                    ok = r.status_code == 200 and answer_bytes(r.content) == expected[i % DISTINCT]
                    why = f"status {r.status_code}" if r.status_code != 200 else "different bytes"
                except httpx.HTTPError as exc:
                    ok, why = False, repr(exc)
                dt = time.perf_counter() - t0
                with lock:
                    if ok:
                        latencies.append(dt)
                    else:
                        failures.append(why)

    threads = [threading.Thread(target=client, args=(ix,)) for ix in per_client]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": total, "ok": len(latencies),
            "failed": len(failures), "failures": sorted(set(failures))[:5],
            "req_per_s": round(len(latencies) / wall, 2),
            "p50_ms": round(percentile(latencies, 0.50) * 1000, 1) if latencies else None,
            "p95_ms": round(percentile(latencies, 0.95) * 1000, 1) if latencies else None}


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = module_command("clef_gguf.server", "--model", args.model, "--port", str(port),
                         "--queue-size", str(max(64, max(args.concurrency) * 2)),
                         "--max-length", str(args.max_length))
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.state_cache_mb is not None:
        cmd += ["--state-cache-mb", str(args.state_cache_mb)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClefError(f"the server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise ClefError("the server did not become healthy in 300 s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model directory or name: start a server for the run")
    src.add_argument("--url", help="a running server")
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=positive_int, default=96, help="requests per level (default 96)")
    p.add_argument("--threads", type=positive_int, default=None, help="tower threads of the server")
    p.add_argument("--max-length", type=positive_int, default=2048)
    p.add_argument("--state-cache-mb", type=megabytes, default=None,
                   help="the started server's state cache (default: serve's). The bodies repeat "
                        f"({DISTINCT} distinct), so with a cache every measured request is a "
                        "repeat the server answers without the tower; 0 measures full decisions")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _measure(args: argparse.Namespace, log_path: Path) -> tuple[list[dict], int]:
    proc = None
    url = args.url
    if args.model:
        proc, url = start_server(args, log_path)
    try:
        with httpx.Client(base_url=url, timeout=600) as http:  # warm-up + reference answers
            expected = []
            for i in range(DISTINCT):
                r = http.post("/v1/systemone", content=body(i))
                r.raise_for_status()
                expected.append(answer_bytes(r.content))
            tokens = r.json()["usage"]["input_tokens"]
        rows = [level(url, c, max(args.requests, c), expected) for c in args.concurrency]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    return rows, tokens


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="clef-bench-") as tmp:  # the server's log, removed after
        rows, tokens = _measure(args, Path(tmp) / "server.log")
    if args.json:
        print(json.dumps({"input_tokens": tokens, "cpus": os.cpu_count(), "levels": rows}))
    else:
        print(f"~{tokens} input tokens per request, {os.cpu_count()} CPUs")
        print(f"{'conc':>5} {'requests':>9} {'ok':>5} {'lost':>5} {'req/s':>8} "
              f"{'p50 ms':>9} {'p95 ms':>9}")
        for r in rows:
            print(f"{r['concurrency']:>5} {r['requests']:>9} {r['ok']:>5} {r['failed']:>5} "
                  f"{r['req_per_s']:>8} {r['p50_ms']:>9} {r['p95_ms']:>9}")
    failed = sum(r["failed"] for r in rows)
    if failed:
        print(f"{failed} requests failed: {[r['failures'] for r in rows]}", file=sys.stderr)
    return 1 if failed else 0

