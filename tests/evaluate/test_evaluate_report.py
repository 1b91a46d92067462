"""report.md and the console table from summaries, and the plots (the eval extra)."""

from __future__ import annotations

import sys

import pytest

from clef_gguf.core import errors
from clef_gguf.evaluate import plots, report

COST = {"tower_bytes": 3 << 20, "peak_rss_bytes": 400 << 20, "records_per_s": 12.5, "tokens_per_s": 9000.0}
BINS = [{"lo": i / 10, "hi": (i + 1) / 10, "n": 2 if i in (4, 8) else 0,
         "confidence": 0.45 if i == 4 else 0.85 if i == 8 else None,
         "accuracy": 0.5 if i in (4, 8) else None} for i in range(10)]
METRICS = {"overall": {"n": 4, "accuracy": 0.5, "nll": 0.9, "ece": 0.2, "brier": 0.6}, "reliability": BINS}
COUNTS = {"records": 3, "answered": 2, "failed": {"invalid_json": 1}, "questions": 6,
          "labelled_questions": 4, "label_errors": 0}


def summaries():
    delta = {"delta": -0.25, "ci95": [-0.5, 0.0], "significant": False}
    return [{"label": "f32", "info": {"quant": "f32"}, "cost": COST, "metrics": METRICS, "is_reference": True,
             "accuracy_ci95": [0.15, 0.85], "notes": ["n = 4 < 300: noise"]},
            {"label": "q4|0", "info": {"quant": "q4_0"}, "cost": dict(COST, tower_bytes=1 << 20),
             "metrics": METRICS, "accuracy_ci95": [0.15, 0.85], "notes": [],
             "agreement": {"overall": {"n": 6, "top1": 0.5, "mean_abs_dp": 0.01, "max_abs_dp": 0.1,
                                       "mean_kl": 0.002},
                           "per_type": {"noul": {"n": 6, "top1": 0.5, "mean_abs_dp": 0.01, "mean_kl": 0.002}},
                           "per_question": {"a": {"n": 6, "top1": 0.5, "mean_abs_dp": 0.01, "mean_kl": 0.002}},
                           "worst_questions": ["a"]},
             "deltas": {"accuracy": delta, "nll": dict(delta, delta=0.1, ci95=[0.05, 0.2], significant=True)}}]


def test_markdown_and_console():
    md = report.markdown(summaries(), data="d.jsonl", counts=COUNTS, seed=3)
    assert md.startswith("# clef-gguf eval: `d.jsonl`")
    assert "3 records, 2 answered, 1 failed, 6 questions" in md and "skipped" not in md
    assert "| q4\\|0 | q4_0 | 1.0 | 400 | 12.5 | 9000 | 0.5000 |" in md  # a | in a label is escaped
    assert "+0.1000 [+0.0500, +0.2000] *" in md and "seed 3" in md and "- n = 4 < 300: noise" in md
    assert "| q4\\|0 | question a | 6 |" in md
    lines = report.console(summaries()).splitlines()
    assert lines[0].split()[:3] == ["model", "MiB", "rec/s"] and len(lines) == 3


def test_size_columns_weigh_agreement_per_byte():
    """Exact tower bytes and top-1 agreement per GiB: a quant with layers kept wider is a few % larger."""
    md = report.markdown(summaries(), data="d.jsonl", counts=COUNTS, seed=3)
    assert "| tower bytes | top-1 per GiB |" in md
    assert "| 0.002000 | 1,048,576 | 512.00 |" in md  # top-1 0.5 over 1 MiB = 1/1024 GiB
    assert "| (reference) | - | - | - | 3,145,728 | - |" in md
    lines = report.console(summaries()).splitlines()
    assert lines[0].split()[-2:] == ["bytes", "top-1/GiB"]
    assert lines[1].split()[-2:] == ["3,145,728", "-"] and lines[2].split()[-2:] == ["1,048,576", "512.00"]
    assert report.per_gib(summaries()[1]) == 512.0 and report.per_gib(summaries()[0]) is None


def test_plots_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    assert plots.reliability(summaries(), tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert plots.tradeoff(summaries(), tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    unlabelled = [dict(s, metrics={"overall": {}, "reliability": []}) for s in summaries()]
    assert plots.reliability(unlabelled, tmp_path / "none.png") is None


def test_plots_without_matplotlib_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(errors.MissingDependency, match=r"clef-gguf\[eval\]"):
        plots.require()
