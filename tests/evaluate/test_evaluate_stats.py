"""Wilson intervals and the paired bootstrap of metric deltas."""

from __future__ import annotations

import numpy as np
import pytest

from clef_gguf.evaluate import stats


def rows(seed: int, n: int = 200, sharpen: float = 1.0) -> list[dict]:
    """Labels drawn from softmax(z); the model says softmax(sharpen * z) (over-confident > 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        z = rng.normal(0, 2, 3)
        target = int(rng.choice(3, p=np.exp(z) / np.exp(z).sum()))
        p = np.exp(sharpen * z) / np.exp(sharpen * z).sum()
        out.append({"line": i, "record_id": None, "question_id": "q", "probs": p.tolist(), "target": target})
    return out


def test_wilson_known_values():
    lo, hi = stats.wilson(8, 10)
    assert (lo, hi) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert stats.wilson(0, 10)[0] == pytest.approx(0.0) and stats.wilson(10, 10)[1] == pytest.approx(1.0)
    assert all(np.isnan(stats.wilson(0, 0)))


def test_identical_models_have_zero_deltas():
    ref = rows(0)
    out = stats.paired_deltas(ref, ref, seed=3, resamples=200)
    for name in stats.DELTA_METRICS:
        assert out[name]["delta"] == 0.0 and out[name]["ci95"] == [0.0, 0.0]
        assert out[name]["significant"] is False


def test_bootstrap_is_reproducible_with_a_seed_and_pairs_by_line():
    ref, model = rows(0), rows(0, sharpen=3.0)
    a = stats.paired_deltas(ref, model, seed=5, resamples=300)
    b = stats.paired_deltas(ref, list(reversed(model)), seed=5, resamples=300)
    c = stats.paired_deltas(ref, model, seed=6, resamples=300)
    assert a == b
    assert a["nll"]["ci95"] != c["nll"]["ci95"]
    assert a["nll"]["delta"] > 0  # over-confidence costs NLL
    lo, hi = a["nll"]["ci95"]
    assert lo <= a["nll"]["delta"] <= hi


def test_bootstrap_ece_point_equals_the_metric():
    from clef_gguf.evaluate import metrics

    ref, model = rows(1), rows(1, sharpen=2.0)
    out = stats.paired_deltas(ref, model, seed=0, resamples=50)
    assert out["ece"]["model"] == pytest.approx(metrics.ece([r["probs"] for r in model],
                                                            [r["target"] for r in model]), abs=1e-12)


def test_auto_decide_note_says_when_n_is_too_small():
    assert len(stats.auto_decide_note({"n": 50})) == 2
    assert len(stats.auto_decide_note({"n": 100})) == 1
    assert stats.auto_decide_note({"n": 300}) == []
