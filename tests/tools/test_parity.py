"""End to end against the transformers reference of the same tiny release (issue 2's gates)."""

import numpy as np
import pytest

from clef_gguf import Clef
from clef_gguf.convert.samples import SAMPLE_REQUESTS
from clef_gguf.tools.parity import Reference, compare, per_request, run_parity


@pytest.fixture(scope="module")
def reference(tiny_release):
    return Reference(tiny_release)


@pytest.mark.parametrize("outtype, max_dp", [("f32", 2e-3), ("f16", 2e-2), ("q8_0", 5e-2)])
def test_gguf_pipeline_matches_transformers(tiny_model_dir_factory, reference, outtype, max_dp,
                                            record_property):
    with Clef.load(tiny_model_dir_factory(outtype), max_length=4096) as clef:
        report = run_parity(clef, reference, SAMPLE_REQUESTS)
    record_property(f"parity_{outtype}", report.to_dict())
    print(f"\nparity {outtype}: max|dp|={report.max_abs_dp:.2e} mean|dp|={report.mean_abs_dp:.2e} "
          f"argmax {report.argmax_agree}/{report.argmax_checked}")
    assert report.questions == 9 and report.options == 27
    assert report.max_abs_dp <= max_dp
    if outtype == "f32":  # the text parity gate: same argmax wherever the reference margin > 0.01
        assert report.argmax_agree == report.argmax_checked > 0


def test_compare_flags_disagreement_and_near_ties():
    ref = [[np.array([0.7, 0.3]), np.array([0.5, 0.495, 0.005])]]
    ours = [[np.array([0.4, 0.6], dtype=np.float32), np.array([0.49, 0.5, 0.01], dtype=np.float32)]]
    report = compare(ours, ref, model="m")
    assert report.argmax_checked == 1 and report.argmax_agree == 0
    assert len(report.near_ties) == 1 and report.near_ties[0]["same_argmax"] is False
    assert abs(report.max_abs_dp - 0.3) < 1e-6


def test_parity_command(tiny_model_dir, tiny_release, tmp_path):
    import json
    import subprocess

    req = tmp_path / "requests.json"
    req.write_text(json.dumps(SAMPLE_REQUESTS[:2]))
    proc = subprocess.run(["clef-gguf", "parity", "--model", str(tiny_model_dir), "--release",
                           str(tiny_release), "--requests", str(req)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["questions"] == 5 and report["max_abs_dp"] <= 2e-3

    bad = subprocess.run(["clef-gguf", "parity", "--model", str(tiny_model_dir), "--release",
                          str(tmp_path / "absent")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------- per request, across boundaries
# Question sets whose schema + suffix segment (192-595 tokens with the tiny tokenizer) ends in a
# last ubatch of 13-60 tokens for the three-question sets, and states whose last ubatch is below and
# above the 64-token tile of ggml's CPU flash attention (docs/parity.md): every segment's tail is
# short somewhere, a state spans several chunks, one request is ~10k tokens.
QUESTIONS = {q: spec for r in SAMPLE_REQUESTS for q, spec in r["questions"].items()}
BOUNDARY_SET = [(1, ("complete",)), (20, ("overdue", "action")), (63, ("bug", "complete", "team")),
                (64, ("overdue", "bug", "complete")), (300, ("overdue", "action", "bug")),
                (575, ("bug", "complete", "team")), (1100, ("overdue", "action", "bug")),
                (4100, ("bug", "complete", "team")), (9000, ("sentiment", "team", "bug"))]
# Measured with the exact attention setting: <= 6.0e-7 on every request of the 18-request set of
# docs/parity.md; the default setting gives 1.3e-5 - 6.3e-5 wherever the last segment's tail is short.
F32_MAX_DP_PER_REQUEST = 2e-6


def state_text(encoder, n: int, seed: int) -> str:
    """Text of exactly ``n`` tokens, words drawn from the converter's corpus."""
    import random

    from clef_gguf.convert.synthetic.corpus import CORPUS

    words, rng, text = CORPUS.split(), random.Random(seed), ""
    while len(encoder.tokenizer.encode(text, add_special_tokens=False).ids) < n + 8:
        text += " " + " ".join(rng.choice(words) for _ in range(64))
    ids = encoder.tokenizer.encode(text, add_special_tokens=False).ids
    cut = encoder.tokenizer.decode(ids[:n])
    while len(encoder.tokenizer.encode(cut, add_special_tokens=False).ids) > n:
        cut = cut[:-1]
    return cut


@pytest.fixture(scope="module")
def boundary_requests(reference):
    return [{"state": state_text(reference.encoder, n, seed), "questions": {q: QUESTIONS[q] for q in qs}}
            for seed, (n, qs) in enumerate(BOUNDARY_SET)]


def test_f32_parity_holds_per_request_across_segment_boundaries(tiny_model_dir, reference,
                                                                 boundary_requests, record_property):
    with Clef.load(tiny_model_dir, max_length=10240) as clef:
        assert clef.info["attention"] == "exact-f32"
        rows = per_request(clef, reference, boundary_requests)
    record_property("parity_per_request", [r.to_dict() for r in rows])
    # the set crosses what it is meant to: short tails in every segment, multi-chunk and long states
    assert all(r.tails["prefix"] < 64 or r.prefix >= 64 for r in rows)
    assert any(r.tails["state"] < 64 and r.state > 512 for r in rows)
    assert sum(r.tails["rest"] < 64 for r in rows) >= 5
    assert max(r.tokens for r in rows) > 9000
    for r in rows:
        assert r.max_abs_dp <= F32_MAX_DP_PER_REQUEST, r.to_dict()


def test_per_layer_rows_on_the_tiny_model(tiny_model_dir, reference, boundary_requests):
    with Clef.load(tiny_model_dir, max_length=4096) as clef:
        plain = per_request(clef, reference, boundary_requests[2:4])
        rows = per_request(clef, reference, boundary_requests[2:4], layers=True)
        n_layer = clef.tower._model.n_layer
    for row, without in zip(rows, plain):
        assert row.max_abs_dp == without.max_abs_dp and not without.layers
        assert row.tails == {"prefix": row.prefix, "state": row.state, "rest": row.rest % 512}
        assert len(row.layers) == n_layer  # after each layer but the last, then the final state
        assert all(0 < d < 1e-3 for d in row.layers), row.layers


def test_parity_command_per_request_with_layers(tiny_model_dir, tiny_release, tmp_path):
    import json
    import subprocess

    req = tmp_path / "requests.json"
    req.write_text(json.dumps(SAMPLE_REQUESTS[:1]))
    base = ["clef-gguf", "parity", "--model", str(tiny_model_dir), "--release", str(tiny_release),
            "--requests", str(req)]
    proc = subprocess.run(base + ["--per-request", "--layers"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["attention"] == "exact-f32" and len(report["requests"]) == 1
    row = report["requests"][0]
    assert row["max_abs_dp"] == report["max_abs_dp"] and len(row["layers"]) == 4
    assert row["prefix"] + row["state"] + row["rest"] == row["tokens"]

    bad = subprocess.run(base + ["--layers"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and json.loads(bad.stdout)["error"]["code"] == "invalid_value"  # a usage error
