"""``clef-gguf bench-server``: requests/s and p50/p95 latency of ``clef-gguf serve`` at several
client concurrencies.

    clef-gguf bench-server --model ./demo-model              # starts a server on a free port
    clef-gguf bench-server --url http://127.0.0.1:8080       # measures a running one

Each level sends ``--requests`` requests from N client threads (each with its own keep-alive
connection), all started together. Every answer is checked: status 200 and the same bytes as a
sequential warm-up run of the same body, so the numbers never hide lost or wrong answers. Where the
server's ``/health`` says its tower or head runs on a GPU the check is a tolerance instead
(``--tolerance``, default ``limits.GPU_MAX_DP``): packed decodes there sum in another order than one
at a time, which the CPU's byte-identity never does.
``--tokens N`` pads each request's state to about N prompt tokens. The server logs go to a
temporary file (printed on failure).

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
from collections.abc import Callable
from pathlib import Path

import httpx

from clef_gguf.bulk.output import CACHE_USAGE
from clef_gguf.core.argtypes import megabytes, positive_int, probability_gap
from clef_gguf.core.children import module_command
from clef_gguf.core.errors import ClefError
from clef_gguf.core.limits import GPU_MAX_DP
from clef_gguf.server.http import free_port

DISTINCT = 16
FILLER = " The customer wrote again about the refund, the invoice and the delay."


def body(i: int, filler: int = 0) -> bytes:
    """Request ``i`` of the ``DISTINCT``, its state padded by ``filler`` sentences."""
    return json.dumps({"state": f"Ticket {i}: refund late by {i} days, amount {12.5 * i}" + FILLER * filler,
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


def _numbers(a: object, b: object) -> float | None:
    """max |a - b| over the numbers of two answers of the same shape; None where the shapes differ."""
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or a is None:
        return 0.0 if a == b else None
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b))
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return None
        found = [_numbers(a[k], b[k]) for k in a]
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        found = [_numbers(x, y) for x, y in zip(a, b)]
    else:
        return None
    numbers = [f for f in found if f is not None]
    return max(numbers, default=0.0) if len(numbers) == len(found) else None


def same_answer(got: bytes, expected: bytes, tolerance: float) -> bool:
    """``answer_bytes`` equal, or (``tolerance`` > 0) the same answer with every number within it."""
    if got == expected or tolerance <= 0:
        return got == expected
    dp = _numbers(json.loads(got), json.loads(expected))
    return dp is not None and dp <= tolerance


def on_gpu(health: dict) -> bool:
    """Whether the server's ``/health`` places its tower (``gpu_layers``) or its head on a GPU."""
    return bool(health.get("gpu_layers")) or not str(health.get("head_device") or "cpu").startswith("cpu")


def default_tolerance(health: dict) -> float:
    """0 (byte-identical answers) where the server runs on the CPU; ``GPU_MAX_DP`` where it runs on a GPU."""
    return GPU_MAX_DP if on_gpu(health) else 0.0


def level(url: str, concurrency: int, total: int, expected: list[bytes], bodies: list[bytes],
          tolerance: float = 0.0) -> dict:
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
                    r = http.post("/v1/systemone", content=bodies[i % DISTINCT])
                    ok = r.status_code == 200 and same_answer(answer_bytes(r.content), expected[i % DISTINCT],
                                                              tolerance)
                    why = f"status {r.status_code}" if r.status_code != 200 else (
                        "different bytes" if tolerance <= 0 else f"an answer moved by more than {tolerance:g}")
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


def _healthy(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=5).status_code == 200


def launch_server(server_args: list[str], log_path: Path, ready: Callable[[str], bool] = _healthy,
                  timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """``python -m clef_gguf.server SERVER_ARGS --port P`` on a free port, its output in ``log_path``;
    returned with its URL once ``ready(url)`` holds (by default: ``/health`` answers 200).

    Raises ClefError with the log's tail when the server exits first or is not ready in ``timeout`` s.
    """
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(module_command("clef_gguf.server", *server_args, "--port", str(port)),
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ClefError(f"the server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                if ready(url):
                    return proc, url
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    except BaseException:
        stop_server(proc)  # a failing check (or Ctrl-C) leaves no server behind
        raise
    stop_server(proc)
    raise ClefError(f"the server was not ready in {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen, grace: float = 60) -> None:
    """SIGTERM first (a Ray Serve server then stops its Ray processes too), SIGKILL after ``grace`` s."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    server_args = ["--model", args.model, "--queue-size", str(max(64, max(args.concurrency) * 2)),
                   "--max-length", str(args.max_length)]
    if args.threads:
        server_args += ["--threads", str(args.threads)]
    if args.state_cache_mb is not None:
        server_args += ["--state-cache-mb", str(args.state_cache_mb)]
    return launch_server(server_args, log_path)


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
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="pad each request's state to about this many prompt tokens (default: short requests)")
    p.add_argument("--tolerance", type=probability_gap, default=None,
                   help="largest |dp| of an answer against its warm-up run (default: 0, byte-identical, on a "
                        f"CPU; {GPU_MAX_DP:g} where the server's /health places its tower or head on a GPU: "
                        "packed GPU decodes sum in another order)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _measure(args: argparse.Namespace, log_path: Path) -> tuple[list[dict], int]:
    proc = None
    url = args.url
    if args.model:
        proc, url = start_server(args, log_path)
    try:
        with httpx.Client(base_url=url, timeout=600) as http:  # warm-up + reference answers
            health = http.get("/health")
            health.raise_for_status()
            filler = _filler(http, args.tokens) if args.tokens else 0
            bodies = [body(i, filler) for i in range(DISTINCT)]
            expected = []
            for b in bodies:
                r = http.post("/v1/systemone", content=b)
                r.raise_for_status()
                expected.append(answer_bytes(r.content))
            tokens = r.json()["usage"]["input_tokens"]
        tolerance = default_tolerance(health.json()) if args.tolerance is None else args.tolerance
        rows = [level(url, c, max(args.requests, c), expected, bodies, tolerance) for c in args.concurrency]
    finally:
        if proc is not None:
            stop_server(proc)
    return rows, tokens


def _filler(http: httpx.Client, tokens: int) -> int:
    """Filler sentences that bring a request to about ``tokens`` prompt tokens (the server's count)."""
    counts = []
    for n in (0, 8):
        r = http.post("/v1/systemone", content=body(0, n))
        r.raise_for_status()
        counts.append(r.json()["usage"]["input_tokens"])
    per = max(1e-9, (counts[1] - counts[0]) / 8)
    return max(0, round((tokens - counts[0]) / per))


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

