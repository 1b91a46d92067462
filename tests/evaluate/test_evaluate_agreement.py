"""Label-free agreement between two models' lines."""

from __future__ import annotations

import pytest

from clef_gguf.evaluate import agreement


def line(i: int, probs: dict) -> dict:
    return {"id": str(i), "record_id": None,
            "questions": {q: {"type": t, "option_ids": [str(j) for j in range(len(p))], "probs": p}
                          for q, (t, p) in probs.items()}}


def test_identical_lines_agree_fully():
    ref = [line(0, {"a": ("noul", [0.7, 0.3]), "b": ("choice", [0.2, 0.5, 0.3])})]
    out = agreement.compare(ref, ref)
    assert out["overall"] == {"n": 2, "top1": 1.0, "mean_abs_dp": 0.0, "max_abs_dp": 0.0,
                              "mean_kl": 0.0, "max_kl": 0.0}


def test_differences_kl_per_type_and_worst_questions():
    ref = [line(0, {"a": ("noul", [0.7, 0.3]), "b": ("choice", [0.2, 0.5, 0.3])}),
           line(1, {"a": ("noul", [0.6, 0.4])})]
    model = [line(0, {"a": ("noul", [0.4, 0.6]), "b": ("choice", [0.2, 0.5, 0.3])}),
             line(1, {"a": ("noul", [0.6, 0.4])}),
             line(2, {"a": ("noul", [0.5, 0.5])})]  # not in the reference: not compared
    out = agreement.compare(ref, model)
    assert out["overall"]["n"] == 3
    assert out["overall"]["top1"] == pytest.approx(2 / 3)
    assert out["overall"]["max_abs_dp"] == pytest.approx(0.3)
    assert out["overall"]["mean_abs_dp"] == pytest.approx(0.6 / 7)
    assert out["per_type"]["noul"]["mean_kl"] == pytest.approx(
        (0.7 * __import__("math").log(0.7 / 0.4) + 0.3 * __import__("math").log(0.3 / 0.6)) / 2)
    assert out["worst_questions"][0] == "a"
