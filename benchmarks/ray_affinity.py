"""State-affine routing against Ray Serve's own rule, side by side (docs/server.md, BENCHMARKS.md).

    clef-gguf demo ./demo-model
    python benchmarks/ray_affinity.py ./demo-model --replicas 2 --threads 1 --rounds 3

For each routing (``--routing state``, then ``spread``: Ray Serve's rule, the less busy of two replicas
drawn at random), alternating over ``--rounds`` rounds, a fresh ``clef-gguf serve --engine ray-serve``:
``--states`` states each asked ``--sets`` question sets, shuffled, from ``--clients`` clients at once.
A repeated state "hits" when its answer says it restored more than the system prefix from the state
cache (``usage.cached_tokens``). Then ``--kill`` long requests in flight at once, and one replica's
process killed one second in: how many failed, and whether every answer equals one process's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from clef_gguf import Clef
from clef_gguf.tools.bench_server import launch_server, stop_server

SETS = [{"urgent": {"type": "noul"}},
        {"refund": {"type": "noul", "instructions": "Should we refund?"},
         "team": {"type": "choice", "criteria": {"billing": None, "shipping": None}}},
        {"anger": {"type": "score", "criteria": ["calm", "annoyed", "angry"]}},
        {"team": {"type": "choice", "criteria": {"billing": None, "shipping": None, "returns": None}}}]


def _metric(url: str, name: str) -> dict[tuple, float]:
    """Each sample of ``name`` in the ingress's /metrics, by its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def _serve(model: str, routing: str, replicas: int, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    """A fresh ``serve --engine ray-serve``, returned once its ingress lists all ``replicas``."""
    return launch_server(["--model", model, "--engine", "ray-serve", "--replicas", str(replicas),
                          "--threads", str(threads), "--routing", routing, "--max-length", "2048"], log,
                         ready=lambda url: _up(url, replicas))


def _up(url: str, replicas: int) -> bool:
    # /health first: until the ingress is deployed Ray's proxy answers /metrics with a 404 page.
    return (httpx.get(url + "/health", timeout=5).status_code == 200
            and len(_metric(url, "clef_replica_info")) == replicas)


def _post(url: str, body: dict) -> tuple[float, httpx.Response]:
    start = time.perf_counter()
    got = httpx.post(url + "/v1/systemone", json=body, timeout=600)
    return time.perf_counter() - start, got


def measure(model: str, routing: str, args: argparse.Namespace, asked: list[dict], prefix: int,
            long_asked: list[dict], want_long: list[dict], log: Path) -> dict:
    proc, url = _serve(model, routing, args.replicas, args.threads, log)
    try:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(lambda body: _post(url, body), asked))
        wall = time.perf_counter() - start
        seen: set[str] = set()
        repeats = hits = 0
        for body, (_, got) in zip(asked, results):
            if body["state"] in seen:
                repeats += 1
                hits += got.json()["usage"]["cached_tokens"] > prefix
            seen.add(body["state"])
        latency = sorted(seconds for seconds, _ in results)
        pids = [int(m) for m in re.findall(r'pid="(\d+)"', httpx.get(url + "/metrics").text)]
        with concurrent.futures.ThreadPoolExecutor(len(long_asked)) as pool:
            flight = [pool.submit(_post, url, body) for body in long_asked]
            time.sleep(1.0)
            os.kill(pids[0], signal.SIGKILL)
            answered = [f.result()[1] for f in flight]
        failed = sum(a.status_code != 200 for a in answered)
        equal = all(a.status_code == 200 and a.json()["answers"] == w for a, w in zip(answered, want_long))
        return {"routing": routing, "hits": hits, "repeats": repeats, "per_s": len(asked) / wall,
                "p50": statistics.median(latency), "p95": latency[int(0.95 * (len(latency) - 1))],
                "failed": failed, "equal": equal,
                "retried": _metric(url, "clef_routing_total").get((("choice", "retried"),), 0)}
    finally:
        stop_server(proc, grace=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model directory (clef-gguf demo DIR)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="per replica")
    parser.add_argument("--states", type=int, default=10)
    parser.add_argument("--sets", type=int, default=4, help="question sets asked of each state")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--kill", type=int, default=24, help="requests in flight when a replica is killed")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    states = [f"Ticket {n}: customer {n} wrote twice about parcel {1000 + n}, which never came. " * 8
              for n in range(args.states)]
    asked = [{"state": states[s], "questions": SETS[q % len(SETS)]} for s in range(args.states)
             for q in range(args.sets)]
    random.Random(0).shuffle(asked)
    long_asked = [{"state": f"Case {n}: " + "the parcel was late and the box was damaged. " * 64,
                   "questions": SETS[1]} for n in range(args.kill)]
    with Clef.load(args.model, threads=args.threads, max_length=2048) as clef:
        prefix = clef.prepare(asked[0]).encoded.prefix_tokens
        want_long = [clef.decide(body)["answers"] for body in long_asked]
    rows: dict[str, list[dict]] = {"state": [], "spread": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for routing in (("state", "spread") if r % 2 == 0 else ("spread", "state")):
                row = measure(args.model, routing, args, asked, prefix, long_asked, want_long,
                              Path(tmp) / f"{routing}-{r}.log")
                rows[routing].append(row)
                print(f"round {r + 1} {routing}: {row}", file=sys.stderr, flush=True)
    print(f"| routing | repeated states that hit, of {len(asked) - args.states} | decisions/s | p50 s | p95 s | "
          f"failed of {args.kill} with a replica killed | answers equal one process's | sent again |")
    print("|---|---|---|---|---|---|---|---|")
    for routing, runs in rows.items():
        def spread(key: str, fmt: str = ".2f") -> str:
            values = [run[key] for run in runs]
            return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

        print(f"| {routing} | {spread('hits', '.0f')} | {spread('per_s')} | {spread('p50')} | {spread('p95')} | "
              f"{spread('failed', '.0f')} | {all(run['equal'] for run in runs)} | {spread('retried', '.0f')} |")


if __name__ == "__main__":
    main()
