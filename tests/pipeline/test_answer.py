"""Answers per type and the envelope, against hand-computed reference values (spec §5)."""

import numpy as np
import pytest

from clef_gguf.pipeline import answer
from clef_gguf.core import errors
from clef_gguf.pipeline.request import parse_request

PROV = answer.Provenance("clef-test", "abc123", "llama-cpp-python", "f32", "tmpl")


def request(questions, model=None):
    body = {"state": "s", "questions": questions}
    if model is not None:
        body["model"] = model
    return parse_request(body)


def test_noul_reports_p_true_only():
    r = request({"n": {"type": "noul"}})
    a = answer.answer(r.questions[0], np.array([0.123456, 0.876544], dtype=np.float32))
    assert a == {"type": "noul", "noul": 0.1235}


def test_choice_reports_request_order_and_first_tied_max():
    r = request({"c": {"type": "choice", "criteria": {"b": None, "a": None, "c": None}}})
    q = r.questions[0]
    assert [o.id for o in q.options] == ["a", "b", "c"]
    # prompt order a, b, c; a and b tie: request order says b comes first
    a = answer.answer(q, np.array([0.4, 0.4, 0.2], dtype=np.float32))
    assert a["choice"] == "b"
    assert list(a["probabilities"]) == ["b", "a", "c"]
    assert a["confidence"] == round(float(np.float32(0.4)), 4)


def test_score_expected_level_and_legend():
    r = request({"s": {"type": "score", "criteria": ["low", {"x": 1}, "high"]}})
    p = np.array([0.2, 0.3, 0.5], dtype=np.float32)
    a = answer.answer(r.questions[0], p)
    expected = sum(i * float(v) for i, v in enumerate(p))
    assert a["score"] == round(expected, 4) == 1.3
    assert a["confidence"] == 0.5
    assert a["legend"] == {"0": "low", "1": {"x": 1}, "2": "high"}
    assert a["probabilities"] == {"0": 0.2, "1": 0.3, "2": 0.5}


@pytest.mark.parametrize("p, reported", [
    (0.00005, 0.0),  # float32 0.00005 is 4.99999987e-05: below the tie, rounds down
    (0.00015, 0.0002),  # float32 1.50000007e-04: above the tie (float64 0.00015 gives 0.0001)
    (0.99995, 0.9999),  # float32 0.999949992: below the tie (float64 0.99995 gives 1.0)
])
def test_rounding_is_pythons_round_of_the_float32_value(p, reported):
    assert answer._r(np.float32(p)) == reported


def test_softmax_is_float32_and_normalised():
    probs = answer.split_probabilities(np.array([1.0, 2.0, 3.0, 0.5, 0.5]), (3, 2))
    assert [p.dtype for p in probs] == [np.float32, np.float32]
    assert probs[1].tolist() == [0.5, 0.5]
    assert abs(float(probs[0].sum()) - 1) < 1e-6
    ref = np.exp([1.0, 2.0, 3.0]) / np.exp([1.0, 2.0, 3.0]).sum()
    assert np.allclose(probs[0], ref, atol=1e-7)


def test_non_finite_logits_are_an_error_not_nan_answers():
    with pytest.raises(errors.InferenceError):
        answer.split_probabilities(np.array([np.nan, 1.0]), (2,))


def test_envelope_echoes_model_and_carries_audit():
    r = request({"n": {"type": "noul"}}, model="my-model")
    probs = [np.array([0.6, 0.4], dtype=np.float32)]
    out = answer.envelope(r, probs, 77, PROV, truncated=False, option_token_ids=np.arange(4),
                          cached_tokens=36)
    assert out["model"] == "my-model"
    assert out["usage"] == {"input_tokens": 77, "output_tokens": 0, "cached_tokens": 36}
    audit = out["audit"]
    assert audit["model_hash"] == "abc123" and audit["input_tokens"] == [77]
    assert audit["prompt_template_sha256"] == ["tmpl"]
    assert len(audit["allowed_token_set_hash"][0]) == 64
    assert "truncated" not in out


def test_envelope_without_model_uses_served_name_and_marks_truncation():
    r = request({"n": {"type": "noul"}})
    out = answer.envelope(r, [np.array([0.5, 0.5], dtype=np.float32)], 5, PROV, truncated=True,
                          option_token_ids=np.arange(2))
    assert out["model"] == "clef-test" and out["truncated"] is True


def test_one_audit_shape_for_a_response_and_a_batch():
    from clef_gguf.pipeline.answer import Provenance, audit, batch_envelope

    p = Provenance("m", "h", "llama-cpp-python", "f32", "t")
    one = audit(p, allowed_token_set_hash=["a"], input_tokens=[5])
    assert one == {"model_hash": "h", "calibration_version": "none", "prompt_template_sha256": ["t"],
                   "allowed_token_set_hash": ["a"], "input_tokens": [5], "backend": "llama-cpp-python",
                   "precision": "f32"}
    empty = audit(p)
    assert empty["prompt_template_sha256"] == empty["input_tokens"] == [] and empty["model_hash"] == "h"
    assert audit(None, {"backend": "b"})["backend"] == "b" and audit(None)["model_hash"] == "unknown"
    r1 = {"model": "m", "answers": {"q": 1}, "usage": {"input_tokens": 5}, "audit": one}
    r2 = {"model": "m", "answers": {"q": 2}, "usage": {"input_tokens": 7}, "truncated": True,
          "audit": audit(p, allowed_token_set_hash=["b"], input_tokens=[7])}
    out = batch_envelope([("x", r1, None), ("y", None, {"code": "invalid_value"}), ("z", r2, None)], "m", empty)
    assert out["results"] == [{"id": "x", "answers": {"q": 1}}, {"id": "y", "error": {"code": "invalid_value"}},
                              {"id": "z", "answers": {"q": 2}, "truncated": True}]
    assert out["usage"] == {"input_tokens": 12, "output_tokens": 0}
    assert out["audit"]["allowed_token_set_hash"] == ["a", "b"] and out["audit"]["input_tokens"] == [5, 7]
    assert batch_envelope([("y", None, {"code": "c"})], "m", empty)["audit"] is empty
