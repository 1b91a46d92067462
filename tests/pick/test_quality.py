"""``pick --eval``: the smallest quant that fits and keeps the reference's answers."""

from __future__ import annotations

import json

import pytest

from clef_gguf.core import errors
from clef_gguf.pick import quality
from clef_gguf.models.placement import Candidate, Recommendation


def model(quant, top1=None, accuracy=None, calibration="none"):
    m = {"label": quant, "info": {"quant": quant.lower(), "calibration_version": calibration}}
    if top1 is not None:
        m["agreement"] = {"overall": {"n": 400, "top1": top1}}
    if accuracy is not None:
        m["deltas"] = {"n": 400, "accuracy": {"delta": accuracy[0], "ci95": [accuracy[1], accuracy[2]]}}
    return m


def candidate(quant, gb, fits=True):
    return Candidate(quant, "src", int(gb * 1e9), "exact", int(gb * 1.3e9), fits, False)


CANDIDATES = [candidate("Q8_0", 9.5), candidate("Q6_K", 7.4), candidate("Q4_K_M", 5.6),
              candidate("IQ2_M", 3.4), candidate("IQ1_S", 2.2, fits=True)]


def recommendation():
    return Recommendation("clef-flash", "Q8_0", "src", "cpu", 16384, int(12e9), int(11e9),
                          "Q8_0 is the best quant that fits.", {}, tuple(CANDIDATES))


def test_min_agreement_picks_the_smallest_that_keeps_it():
    summary = {"models": [model("Q8_0"), model("Q4_K_M", top1=0.995), model("IQ2_M", top1=0.93),
                          model("IQ1_S", top1=0.7)]}
    rec = quality.apply(recommendation(), summary, 0.99)
    assert rec.quant == "Q4_K_M" and rec.placement == "cpu" and rec.need_bytes == CANDIDATES[2].need_bytes
    assert "top-1 agreement 0.9950 with Q8_0 on 400 questions (>= 0.99)" in rec.reason
    assert "IQ2_M (top-1 agreement 0.9300" in rec.reason and "IQ1_S" in rec.reason
    assert quality.apply(recommendation(), summary, 0.9).quant == "IQ2_M"


def test_two_runs_of_one_quant_type_give_the_verdict_that_does_not_keep():
    for order in ((0.995, 0.90), (0.90, 0.995)):
        summary = {"models": [model("Q8_0"), *(model("Q4_K_M", top1=t) for t in order)]}
        assert quality.verdicts(summary, 0.99)["Q4_K_M"].keeps is False


def test_without_min_agreement_the_accuracy_interval_decides():
    summary = {"models": [model("Q8_0"), model("Q4_K_M", top1=0.97, accuracy=(-0.004, -0.02, 0.01)),
                          model("IQ2_M", top1=0.95, accuracy=(-0.05, -0.08, -0.02))]}
    rec = quality.apply(recommendation(), summary, None)
    assert rec.quant == "Q4_K_M" and "within the 95% bootstrap interval" in rec.reason
    unlabelled = {"models": [model("Q8_0"), model("Q4_K_M", top1=0.97)]}  # no labels: 0.99 agreement
    assert quality.apply(recommendation(), unlabelled, None).quant == "Q8_0"


def test_a_decision_index_benchmark_significantly_worse_rejects_the_quant():
    worse = model("Q4_K_M", top1=0.995, accuracy=(-0.001, -0.01, 0.008))
    worse["benchmark_deltas"] = {"Home appliances": {"accuracy": {"delta": -0.05, "ci95": [-0.09, -0.01]}},
                                 "Forecasts": {"accuracy": {"delta": 0.0, "ci95": [-0.02, 0.02]}}}
    fine = model("Q6_K", top1=0.999, accuracy=(0.0, -0.01, 0.01))
    fine["benchmark_deltas"] = {"Home appliances": {"accuracy": {"delta": 0.0, "ci95": [-0.02, 0.02]}}}
    summary = {"models": [model("Q8_0"), fine, worse]}
    found = quality.verdicts(summary, None)
    assert found["Q6_K"].keeps and not found["Q4_K_M"].keeps
    assert "Home appliances (-0.0500" in found["Q4_K_M"].why and "Forecasts" not in found["Q4_K_M"].why
    assert quality.apply(recommendation(), summary, None).quant == "Q6_K"
    assert quality.verdicts(summary, 0.99)["Q4_K_M"].keeps  # --min-agreement is the user's own rule


def test_nothing_fits_and_keeps_or_no_evidence_keeps_the_memory_choice():
    summary = {"models": [model("Q8_0"), model("Q4_K_M", top1=0.9)]}
    rec = quality.apply(recommendation(), summary, 0.99)  # only the reference keeps its answers
    assert rec.quant == "Q8_0" and "Smaller but rejected by the eval: Q4_K_M" in rec.reason
    too_big = [candidate("Q8_0", 9.5, fits=False), candidate("Q4_K_M", 5.6)]
    rec = quality.apply(Recommendation("clef-flash", "Q4_K_M", "src", "cpu", 16384, 1, 1, "r", {},
                                        tuple(too_big)), {"models": [model("Q8_0"), model("Q4_K_M", top1=0.5)]},
                         0.99)
    assert rec.quant == "Q4_K_M" and "No quant the eval compared" in rec.reason
    other = {"models": [model("F32"), model("Q4_0", top1=1.0)]}  # the demo's quants: not in the family
    assert "memory-only choice stands" in quality.apply(recommendation(), other, 0.99).reason
    calibrated = {"models": [model("Q8_0"), model("IQ1_S", top1=1.0, calibration="cal-1")]}
    assert quality.apply(recommendation(), calibrated, 0.99).quant == "Q8_0"


def test_load_refuses_what_is_not_a_side_by_side_eval(tmp_path):
    with pytest.raises(errors.InvalidValue, match="cannot read"):
        quality.load(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"models": [model("Q8_0")]}))
    with pytest.raises(errors.InvalidValue, match="one model"):
        quality.load(tmp_path)
    (tmp_path / "summary.json").write_text("{")
    with pytest.raises(errors.InvalidValue, match="not an eval summary"):
        quality.load(tmp_path)


def test_min_agreement_flag_type():
    import argparse

    assert quality.agreement("0.99") == 0.99
    for bad in ("1.5", "-0.1", "high"):
        with pytest.raises(argparse.ArgumentTypeError):
            quality.agreement(bad)


def test_pick_eval_on_the_command_line(monkeypatch, tmp_path, capsys):
    import argparse

    from machine_helpers import box
    from clef_gguf.pick import command as pick

    monkeypatch.setattr(pick, "probe", lambda **_: box(ram=64))
    (tmp_path / "summary.json").write_text(json.dumps({"models": [
        model("Q8_0"), model("Q4_K_M", top1=0.995), model("IQ2_M", top1=0.93)]}))
    parser = argparse.ArgumentParser()
    pick.add_arguments(parser)
    assert pick.run(parser.parse_args(["--no-probe", "--eval", str(tmp_path), "--min-agreement", "0.99"])) == 0
    out = capsys.readouterr().out
    assert "Recommended: clef-flash:Q4_K_M" in out and "top-1 agreement 0.9950" in out
    assert pick.run(parser.parse_args(["--no-probe", "--eval", str(tmp_path), "--json"])) == 0
    assert json.loads(capsys.readouterr().out)["recommendation"]["quant"] == "Q4_K_M"  # no labels: 0.99
    with pytest.raises(errors.InvalidValue, match="--eval"):
        pick.run(parser.parse_args(["--min-agreement", "0.9"]))
