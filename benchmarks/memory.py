"""Peak memory of one decision at the real size, and what it is made of (BENCHMARKS.md, docs/models.md).

    python -m clef_gguf.convert.synthetic.big ./flash-q4 --outtype Q4_K_M --vision
    python benchmarks/memory.py ./flash-q4 --tokens 500 2000 8000 --scenarios decide serve evidence picture

Each scenario and length runs in a fresh process of its own (so that each peak is its own), which
samples its ``/proc/self/status`` every few milliseconds from a thread while it works, and marks where
each stage starts: Python and torch imported, the model loaded, the decision (or, for ``serve``, four
concurrent requests through the real server). Beside the samples it reads llama.cpp's own buffer sizes
from its log (model, KV, recurrent state, compute, output) and the head's weights. The parts:

- python+torch: RSS once the imports are done;
- tower resident: the tower's pages in memory at the peak: the mapped file's (RssFile) and llama.cpp's
  repacked copies (its CPU_REPACK buffer, anonymous);
- head: the joint head's parameters (their bytes, in the dtype they run in);
- kv+recurrent, compute: llama.cpp's buffers as its log reports them;
- head activations: the head stage's own peak above the RSS it started at;
- state cache: the snapshots the decision left in the model's state cache (``--state-cache-mb`` bounds them);
- rest: what the peak holds beyond those (the tokenizer, lexical rows, hidden states, allocator slack).

``--json FILE`` writes the rows; the table goes to stdout (``--table FILE...`` prints it again from such
files). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from clef_gguf.core.limits import GiB, KiB, MiB

SAMPLE_S = 0.002
SCENARIOS = ("decide", "serve", "evidence", "picture")
CONCURRENT = 4  # serve: requests in flight at once
PICTURE = 448  # serve's and decide's picture: 448 x 448 pixels, 196 tokens at Clef-Flash's processor
_BUFFER = re.compile(r"(\w+)\s+(model|KV|RS|compute|output) buffer size =\s*([0-9.]+) MiB")


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(value.split()[0]) * KiB
    return out


def mapped_rss(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process now (``/proc/self/smaps``)."""
    target, total, inside = str(path.resolve()), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if head and "-" in head[0] and len(head) >= 5 and head[0][0] in "0123456789abcdef":
                inside = len(head) == 6 and head[5].strip() == target
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * KiB
    return total


class Sampler:
    """RSS samples of this process, from a thread, with the times stages start."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int, int]] = []  # (time, rss, anon, file)
        self.marks: list[tuple[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            s = _status()
            self.samples.append((time.monotonic(), s["VmRSS"], s["RssAnon"], s["RssFile"]))
            time.sleep(SAMPLE_S)

    def mark(self, stage: str) -> None:
        s = _status()
        now = time.monotonic()
        self.samples.append((now, s["VmRSS"], s["RssAnon"], s["RssFile"]))
        self.marks.append((stage, now))

    def stop(self) -> None:
        self.mark("end")
        self._stop.set()
        self._thread.join()

    def peak(self, start: float = 0.0, end: float = float("inf")) -> tuple[float, int, int, int]:
        inside = [s for s in self.samples if start <= s[0] <= end]
        return max(inside, key=lambda s: s[1])

    def at(self, when: float) -> tuple[float, int, int, int]:
        return min(self.samples, key=lambda s: abs(s[0] - when))


def _request(clef, tokens: int, picture: bool) -> dict:
    from clef_gguf.tools.workload import sized_request, with_picture

    if not picture:
        return sized_request(clef, tokens)
    probe = with_picture(sized_request(clef, 64), PICTURE)
    media = clef.prepare(probe).encoded.n_tokens - clef.prepare(sized_request(clef, 64)).encoded.n_tokens
    return with_picture(sized_request(clef, max(64, tokens - media)), PICTURE)


def _serve(clef, request: dict) -> list[dict]:
    """``CONCURRENT`` copies of ``request`` (each its own state) through the real server, at once."""
    import httpx
    import uvicorn

    from clef_gguf.server.app import create_app
    from clef_gguf.server.http import listen

    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(clef), log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    bodies = [{**request, "state": f"{i}: " + request["state"]} for i in range(CONCURRENT)]
    out: list[dict] = [{}] * CONCURRENT

    def post(i: int) -> None:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/systemone", json=bodies[i], timeout=3600)
        out[i] = r.json()

    posts = [threading.Thread(target=post, args=(i,)) for i in range(CONCURRENT)]
    for t in posts:
        t.start()
    for t in posts:
        t.join()
    server.should_exit = True
    thread.join(30)
    return out


def child(spec: dict) -> dict:
    """One scenario in this process: the samples' peak and its parts."""
    sampler = Sampler()
    import logging

    import torch  # noqa: F401 - the imports are the first stage's own memory

    from clef_gguf import Clef

    buffers: list[str] = []

    class Buffers(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "buffer size" in record.getMessage():
                buffers.append(record.getMessage())

    tower_log = logging.getLogger("clef_gguf.tower.llama")
    tower_log.setLevel(logging.DEBUG)
    tower_log.addHandler(Buffers())
    sampler.mark("load")
    clef = Clef.load(spec["model"], threads=spec["threads"], max_length=spec["max_length"])
    heads: list[tuple[float, float]] = []
    forward = clef.head.forward

    def timed_head(*args, **kwargs):
        start = time.monotonic()
        sampler.mark("head")
        try:
            return forward(*args, **kwargs)
        finally:
            sampler.mark("head-end")
            heads.append((start, time.monotonic()))

    clef.head.forward = timed_head  # the instance attribute: nn.Module.__call__ finds it first
    request = _request(clef, spec["tokens"], spec["scenario"] == "picture")
    tokens = clef.prepare(request).encoded.n_tokens
    sampler.mark("decision")
    if spec["scenario"] == "serve":
        answers = _serve(clef, request)
        assert all("answers" in a for a in answers), answers
    else:
        from clef_gguf.core.errors import InferenceError

        try:
            out = clef.decide(request, evidence=True if spec["scenario"] == "evidence" else None)
            assert "answers" in out
        except InferenceError as exc:  # random weights can overflow on long prompts; the pass itself ran
            if "non-finite" not in exc.message:
                raise
    tower_mapped = mapped_rss(Path(clef.files.tower))
    sampler.stop()
    marks = dict(sampler.marks)
    peak = sampler.peak()
    decision_peak = sampler.peak(marks["decision"])
    head_bytes = sum(p.numel() * p.element_size() for p in clef.head.parameters())
    found: dict[str, float] = {}
    for line in buffers:
        m = _BUFFER.search(line)
        if m:
            key = f"{m.group(1)}_{m.group(2)}"
            found[key] = found.get(key, 0.0) + float(m.group(3)) * MiB
    activations = max((sampler.peak(a, b)[1] - sampler.at(a)[1] for a, b in heads), default=0)
    tower_file = Path(clef.files.tower).stat().st_size
    out = {"scenario": spec["scenario"], "tokens": tokens, "requested_tokens": spec["tokens"],
           "max_length": spec["max_length"], "tower_file": tower_file,
           "peak_rss": peak[1], "peak_anon": peak[2], "peak_file": peak[3], "tower_mapped": tower_mapped,
           "peak_stage": max((s for s, t in sampler.marks if t <= peak[0]), key=lambda s: marks[s], default="start"),
           "decision_peak_rss": decision_peak[1], "decision_peak_file": decision_peak[3],
           "after_load_rss": sampler.at(marks["decision"])[1],
           "python_torch": sampler.at(marks["load"])[1], "head_weights": head_bytes,
           "head_activations": activations, "state_cache": clef.state_cache.nbytes,
           "buffers": {k: round(v) for k, v in found.items()}}
    clef.close()
    return out


def _row(r: dict) -> str:
    b = r["buffers"]
    repack = b.get("CPU_REPACK_model", 0)
    kv = b.get("CPU_KV", 0) + b.get("CPU_RS", 0)
    compute = b.get("CPU_compute", 0) + b.get("CPU_output", 0)
    known = (r["python_torch"] + r["tower_mapped"] + repack + r["head_weights"] + kv + compute + r["head_activations"]
             + r.get("state_cache", 0))
    g = lambda n: f"{n / GiB:.2f}"  # noqa: E731
    return (f"| {r['scenario']} | {r['tokens']:,} | {r['max_length']:,} | {g(r['tower_file'])} | "
            f"{g(r['peak_rss'])} ({r['peak_stage']}) | "
            f"**{g(r['peak_rss'] - r['tower_file'])}** | {g(r['decision_peak_rss'])} | "
            f"{g(r['python_torch'])} | {g(r['tower_mapped'])} + {g(repack)} | {g(r['head_weights'])} | "
            f"{g(kv)} | {g(compute)} | {g(r['head_activations'])} | {g(r.get('state_cache', 0))} | "
            f"{g(r['decision_peak_rss'] - known)} |")


HEADER = ("| scenario | prompt tokens | context | tower file | peak RSS (stage) | beyond the file | decision's peak | "
          "python+torch | tower resident (mapped + repacked) | head | kv+recurrent | compute+output | "
          "head activations | state cache | rest |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))), flush=True)
        return
    if len(sys.argv) >= 3 and sys.argv[1] == "--table":  # the table of rows written before (--json)
        print(HEADER)
        for path in sys.argv[2:]:
            for row in json.loads(Path(path).read_text()):
                print(_row(row))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model directory (python -m clef_gguf.convert.synthetic.big DIR ...)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[500, 2000], help="prompt lengths")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=["decide"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-length", type=int, default=16384, help="the context the model loads with")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    print(HEADER, flush=True)
    for scenario in args.scenarios:
        for tokens in args.tokens:
            spec = {"model": args.model, "scenario": scenario, "tokens": tokens, "threads": args.threads,
                    "max_length": args.max_length}
            done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                print(f"| {scenario} | {tokens} | failed: {done.stderr.strip()[-300:]} |", flush=True)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(_row(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
