"""``clef-gguf bench --versus llama-server``: a decision here vs upstream llama-server's native clef
path on the same model, side by side (``versus.alternate``: ABAB then BABA, median and spread).

Upstream (llama.cpp b11434: ``src/models/clef.cpp``, ``tools/server/server-decision.cpp``) runs the
joint head inside the ggml graph of a native ``clef`` GGUF, which its converter writes with the head
inside (``benchmarks/upstream_convert.py``). Its clef graph has no memory module: every request is
evaluated from token 0 in one ubatch (``-ub`` must hold the whole prompt), with no prefix reuse.

What is like for like, and why ours is the in-process ``Clef`` rather than ``clef-gguf serve``:
- the same weights: ``clef-gguf convert split`` of upstream's own file gives our tower its tensor
  bytes and our head upstream's (dequantized) values; the report checks the tower layouts match;
- the same n_ubatch on both sides (``--ubatch``, default: the smallest multiple of 512 that holds
  the longest prompt, upstream's minimum). Our tower is reloaded at it; our server has no such
  setting, which is why ours runs in process;
- the same threads (``--threads``, also the head's torch threads) and weight kernels: upstream gets
  ``--no-repack`` where our tower goes without ggml's repacked (AMX) buffers;
- the same token ids, checked: both sides count the prompt, and the report says if they differ;
- HTTP is upstream's cost only: its loopback round trip (``GET /health``) is measured and reported
  so that a reader can see it is noise next to a decode.

Measured: ``single``, one decision (our state cache off) vs one upstream request; ``reuse``, four
question sets about one state, our state cache (emptied each round) vs four upstream requests;
``agreement``, max |dp| between upstream's probabilities and ours (unrounded) on every request.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_gguf.core.argtypes import positive_int
from clef_gguf.core.errors import InferenceError, InvalidValue, Unsupported
from clef_gguf.core.questions import Criteria, Part
from clef_gguf.server.http import free_port

if TYPE_CHECKING:
    import httpx

ENV_BINARY = "LLAMA_SERVER"
# Upstream turns this prefix of its internal markers into "<<clef " wherever it meets it.
_MARKER = "<<clef:"
# server-decision.cpp's limits for clef: options of any question, levels of a list-of-levels type.
_MAX_OPTIONS, _SCORE_LEVELS = 255, (2, 10)
UBATCH_STEP = 512


# --------------------------------------------------------------------------- request / response

def upstream_request(request: dict) -> dict:
    """The body upstream's native clef path turns into our prompt, token for token.

    The request is read with the reference's rules (``parse_request``) and written out explicitly,
    so nothing is left to the two sides' defaults: a missing instruction becomes the question id
    (the reference's fallback; upstream requires one), noul criteria carry both descriptions,
    choice criteria keep the request order (both sides sort them by key into the prompt). What
    upstream would render differently is refused (``Unsupported``) instead of measured.
    """
    from clef_gguf.pipeline.request import parse_request

    if _MARKER in json.dumps(request, ensure_ascii=False):
        raise Unsupported(f"the text holds {_MARKER!r}, which upstream rewrites", field="state")
    parsed = parse_request(request)
    questions = {}
    for q in parsed.questions:
        where = f"questions.{q.id}"
        if q.instruction in ("", None):
            raise Unsupported("upstream refuses an empty instruction (the question id is empty too)",
                              field=f"{where}.instructions")
        descriptions = {o.id: o.description for o in q.options}
        rule = q.question_type.criteria
        if rule is Criteria.FIXED and None in descriptions.values():
            raise Unsupported(f"an explicit null {q.type} description: upstream renders its default "
                              "text there, the reference none", field=f"{where}.criteria")
        if rule is Criteria.LEVELS and not _SCORE_LEVELS[0] <= len(q.options) <= _SCORE_LEVELS[1]:
            raise Unsupported(f"upstream takes {_SCORE_LEVELS[0]} to {_SCORE_LEVELS[1]} {q.type} levels",
                              field=f"{where}.criteria")
        if len(q.options) > _MAX_OPTIONS:
            raise Unsupported(f"upstream takes at most {_MAX_OPTIONS} options", field=f"{where}.criteria")
        # the criteria as sent back: a list of levels, else an object in report order
        criteria: dict[str, Any] | list[Any] = (list(q.legend) if rule is Criteria.LEVELS
                                                else {key: descriptions[key] for key in q.report_order})
        questions[q.id] = {"type": q.type, "instructions": q.instruction, "criteria": criteria}
    return {"state": parsed.state, "questions": questions}


def upstream_probabilities(response: dict, request: dict) -> tuple[dict[str, dict[str, float]], int]:
    """({question: {option: p}}, input tokens) from upstream's answer to ``upstream_request(request)``.

    A noul answer carries p(true) only; choice and score answers carry every option. Anything else
    (an error body, a question missing, an option too many) raises ``InferenceError``.
    """
    from clef_gguf.pipeline.request import parse_request

    if not isinstance(response, dict):
        raise InferenceError("llama-server answered with something that is not a JSON object")
    if "error" in response:
        error = response["error"] if isinstance(response["error"], dict) else {}
        raise InferenceError(f"llama-server: {error.get('message', response['error'])}")
    answers = response.get("answers")
    if not isinstance(answers, dict):
        raise InferenceError("llama-server answered without an 'answers' object")
    out: dict[str, dict[str, float]] = {}
    for q in parse_request(request).questions:
        got = answers.get(q.id)
        if not isinstance(got, dict) or got.get("type") != q.type:
            raise InferenceError(f"llama-server gave no {q.type} answer for {q.id!r}")
        keys = {item.part: item.key for item in q.question_type.answer}
        if Part.PROBABILITIES not in keys:  # a two-option type answers with its first option's p only
            p = float(got[keys[Part.FIRST]])
            first, second = q.report_order
            out[q.id] = {first: p, second: 1.0 - p}
            continue
        probs = {str(k): float(v) for k, v in (got.get("probabilities") or {}).items()}
        if set(probs) != {o.id for o in q.options}:
            raise InferenceError(f"llama-server's options for {q.id!r} are {sorted(probs)}, "
                                 f"not {sorted(o.id for o in q.options)}")
        out[q.id] = probs
    tokens = (response.get("usage") or {}).get("input_tokens")
    return out, int(tokens) if isinstance(tokens, int) else -1


def our_probabilities(clef, request: dict) -> tuple[dict[str, dict[str, float]], int]:
    """({question: {option: p}}, prompt tokens): our probabilities before the 4-decimal rounding."""
    from clef_gguf.pipeline import answer
    from clef_gguf.tools.versus import swapped_state_cache

    with swapped_state_cache(clef):
        prepared = clef.prepare(request)
        logits = clef.logits(prepared.encoded)
    probs = answer.split_probabilities(logits, prepared.encoded.option_counts)
    return ({q.id: {o.id: float(p) for o, p in zip(q.options, pq)}
             for q, pq in zip(prepared.request.questions, probs)}, int(prepared.encoded.n_tokens))


def max_abs_dp(ours: dict, theirs: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for qid, options in ours.items():
        for key, p in options.items():
            dp = abs(p - theirs[qid][key])
            if dp >= worst:
                worst, where = dp, f"{qid}.{key}"
    return worst, where


# --------------------------------------------------------------------------- the upstream process

class LlamaServer:
    """``llama-server`` on a loopback port, its log in a temporary file (shown when it fails)."""

    def __init__(self, binary: str, gguf: str, *, threads: int, ubatch: int, n_ctx: int, repack: bool):
        self.port = free_port()
        self.args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-t", str(threads), "-tb", str(threads), "-b", str(ubatch), "-ub", str(ubatch),
                     "-c", str(n_ctx), "-np", "1", "--no-webui"] + ([] if repack else ["--no-repack"])
        self.log = tempfile.NamedTemporaryFile(prefix="clef-llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        self.http: httpx.Client | None = None  # once wait_ready has started

    def log_tail(self, n: int = 15) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = 600.0) -> None:
        import httpx

        self.http = http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=3600)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise InferenceError(f"llama-server exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise InferenceError(f"llama-server was not ready within {timeout:g} s:\n{self.log_tail()}")

    def _client(self) -> httpx.Client:
        if self.http is None:
            raise RuntimeError("LlamaServer.wait_ready first")
        return self.http

    def decide(self, body: bytes) -> dict:
        r = self._client().post("/v1/systemone", content=body, headers={"Content-Type": "application/json"})
        try:
            payload = r.json()
        except ValueError:
            raise InferenceError(f"llama-server answered {r.status_code} without JSON") from None
        if r.status_code != 200 and "error" not in payload:
            raise InferenceError(f"llama-server answered {r.status_code}")
        return payload

    def roundtrip_ms(self, n: int = 21) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self._client().get("/health")
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times) * 1e3, 3)

    def version(self) -> str:
        proc = subprocess.run([self.args[0], "--version"], capture_output=True, text=True, timeout=60)
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "version" in ln.lower()]
        return lines[0].strip() if lines else "unknown"

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


# --------------------------------------------------------------------------- the comparison

def ubatch_for(n_tokens: int) -> int:
    """Upstream's smallest usable n_ubatch for a prompt of ``n_tokens``, on a 512 grid."""
    return max(UBATCH_STEP, -(-n_tokens // UBATCH_STEP) * UBATCH_STEP)


def _use_ubatch(clef, n_ubatch: int) -> None:
    """Reload our tower at ``n_ubatch`` (llama.cpp fixes it when the context is made)."""
    from clef_gguf.tower.llama_tower import Tower

    old = clef.tower
    if old.n_batch == n_ubatch:
        return
    clef.tower = Tower.load(old.path, n_ctx=old.n_ctx, threads=old.threads, n_batch=n_ubatch,
                            gpu_layers=old.gpu_layers)
    old.close()


def tower_layout_matches(ours: Path, native: Path) -> bool:
    """Whether our tower and the native file's non-head tensors have the same names, types, shapes."""
    from clef_gguf.convert.split import HEAD_NAMESPACES
    from clef_gguf.formats.gguf import open_gguf

    def layout(path, skip):
        return {(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape))
                for t in open_gguf(path).tensors if not t.name.startswith(skip)}

    return layout(ours, ()) == layout(native, HEAD_NAMESPACES)


def versus_llama_server(clef, binary: str, native: str, request: dict, state: str,
                        question_sets: list[dict], rounds: int, ubatch: int | None = None) -> dict:
    from clef_gguf.tower.cache import StateCache
    from clef_gguf.tools.versus import alternate, decide_cold, swapped_state_cache
    from clef_gguf.tower.llama_tower import extra_buffer_types

    reuse = [{"state": state, "questions": q} for q in question_sets]
    bodies = [json.dumps(upstream_request(r), ensure_ascii=False).encode() for r in [request] + reuse]
    longest = max(clef.prepare(r).encoded.n_tokens for r in [request] + reuse)
    n_ubatch = ubatch or ubatch_for(longest)
    if n_ubatch < longest:
        raise InvalidValue(f"--ubatch {n_ubatch} is below the longest prompt ({longest} tokens): "
                           "upstream evaluates a clef prompt in one ubatch", field="ubatch")
    _use_ubatch(clef, n_ubatch)
    server = LlamaServer(binary, native, threads=clef.tower.threads, ubatch=n_ubatch,
                         n_ctx=clef.tower.n_ctx, repack=extra_buffer_types())
    cached = StateCache(clef.state_cache.max_bytes or StateCache().max_bytes)
    try:
        server.wait_ready()
        agreement: dict[str, Any] = {"requests": len(bodies), "max_abs_dp": 0.0, "where": "", "tokens_ours": [],
                     "tokens_upstream": []}
        for r, body in zip([request] + reuse, bodies):  # also the warm-up of both sides
            theirs, n_theirs = upstream_probabilities(server.decide(body), r)
            ours, n_ours = our_probabilities(clef, r)
            dp, where = max_abs_dp(ours, theirs)
            agreement["tokens_ours"].append(n_ours)
            agreement["tokens_upstream"].append(n_theirs)
            if dp >= agreement["max_abs_dp"]:
                agreement["max_abs_dp"], agreement["where"] = float(f"{dp:.3g}"), where  # 3 digits, even at 1e-7
        agreement["same_tokens"] = agreement["tokens_ours"] == agreement["tokens_upstream"]

        def theirs_reuse():
            for body in bodies[1:]:
                server.decide(body)

        with swapped_state_cache(clef) as plain:
            single = alternate(lambda: decide_cold(clef, plain, [request]), lambda: server.decide(bodies[0]),
                               rounds)
            shared = alternate(lambda: decide_cold(clef, cached, reuse), theirs_reuse, rounds)
        http_ms = server.roundtrip_ms()
        version = server.version()
    finally:
        server.close()
    return {"versus": "llama-server",
            "upstream": {"binary": str(binary), "gguf": str(native), "version": version,
                         "args": server.args[3:], "http_roundtrip_ms": http_ms},
            "n_ubatch": n_ubatch, "tower_layout_matches": tower_layout_matches(clef.files.tower, Path(native)),
            "single": {"tokens": agreement["tokens_ours"][0], "a": "clef-gguf decide (no cache)",
                       "b": "llama-server /v1/systemone", **single},
            "reuse": {"state_tokens": clef.prepare(reuse[0]).encoded.state_tokens,
                      "question_sets": len(reuse), "a": f"{len(reuse)} question sets, state cache",
                      "b": f"{len(reuse)} llama-server requests", **shared},
            "agreement": agreement}


# --------------------------------------------------------------------------- bench wiring

def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--versus llama-server")
    g.add_argument("--llama-server", metavar="PATH",
                   help=f"upstream llama-server binary with the native clef path (default ${ENV_BINARY})")
    g.add_argument("--native-gguf", metavar="FILE",
                   help="the native clef GGUF upstream serves (head inside); --model should be its "
                        "`clef-gguf convert split`, so that both sides run the same weights")
    g.add_argument("--ubatch", type=positive_int, metavar="N",
                   help="n_ubatch of both sides (default: the smallest multiple of 512 that holds "
                        "the longest prompt, upstream's minimum)")


def from_args(clef, args: argparse.Namespace, request: dict, question_sets: list[dict]) -> dict:
    binary = args.llama_server or os.environ.get(ENV_BINARY)
    if not binary or not os.access(binary, os.X_OK):
        raise InvalidValue(f"--versus llama-server needs an executable llama-server: --llama-server "
                           f"PATH or ${ENV_BINARY} (got {binary!r})", field="llama_server")
    if not args.native_gguf or not Path(args.native_gguf).is_file():
        raise InvalidValue("--versus llama-server needs --native-gguf FILE (the native clef GGUF)",
                           field="native_gguf")
    return versus_llama_server(clef, binary, args.native_gguf, request, request["state"],
                               question_sets, args.rounds, args.ubatch)
