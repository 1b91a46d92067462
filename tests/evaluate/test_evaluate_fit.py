"""Temperature fitting on synthetic logits: labels drawn at T recover T; KL to a reference."""

from __future__ import annotations

import numpy as np
import pytest

from clef_gguf.evaluate import fit


def sampled(t: float, n: int, k: int, seed: int) -> list[fit.Item]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        z = rng.normal(0, 3, k)
        p = np.exp(z / t) / np.exp(z / t).sum()
        out.append(fit.Item("choice", z, target=int(rng.choice(k, p=p))))
    return out


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0, 4.0])
def test_labels_drawn_at_t_recover_t(t):
    found = fit.fit_temperature(sampled(t, 3000, 4, seed=1))
    assert found == pytest.approx(t, rel=0.12)


def test_kl_fit_recovers_the_reference_scale():
    rng = np.random.default_rng(0)
    items = []
    for _ in range(200):
        z = rng.normal(0, 2, 5)
        ref = np.exp(z / 1.7) / np.exp(z / 1.7).sum()
        items.append(fit.Item("score", z, reference=ref))
    assert fit.fit_temperature(items) == pytest.approx(1.7, rel=1e-4)


def test_bands_fall_back_to_the_type_then_to_one():
    items = sampled(2.0, 80, 4, seed=2) + sampled(2.0, 10, 12, seed=3) + [
        fit.Item("noul", np.array([0.5, -0.5]), target=0)] * 5
    table = fit.fit_table(items, min_questions=30)
    assert table["choice.3_5"]["source"] == "band" and table["choice.3_5"]["n"] == 80
    assert table["choice.11"]["source"] == "type" and table["choice.11"]["n"] == 10
    assert table["choice.11"]["temperature"] == table["choice"]["temperature"]
    assert table["noul"] == {"temperature": 1.0, "source": "default", "n": 5}
    assert table["noul.2"]["source"] == "default"
    assert table["score.6_10"] == {"temperature": 1.0, "source": "default", "n": 0}
    assert set(table) == {"noul", "noul.2", "choice", "score"} | {
        f"{t}.{b}" for t in ("choice", "score") for b in ("2", "3_5", "6_10", "11")}
