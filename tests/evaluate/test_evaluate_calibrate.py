"""``clef-gguf calibrate``: temperatures recovered from labels drawn at a known T, label-free
against the f32 reference, the held-out check and its refusal, and the file in use."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from clef_gguf.core import errors
from clef_gguf.cli import main
from clef_gguf.evaluate import calibrate, demo, fit, predict
from clef_gguf.evaluate import records as labelled
from eval_helpers import QUESTIONS, sharpened, with_sampled_targets

N_RECORDS = 40  # x 6 questions (2 per type)
# Each record is labelled COPIES times (independent draws, as by several annotators), so a band
# is fitted on 1,200 labels of 80 distinct questions. Over 20 label seeds on this model the fitted
# T stayed within -14%..+30% of the truth per band (noul, with the smallest logit gaps, the
# widest) and within -6%..+11% for the mean over the three types: hence these tolerances.
COPIES = 20
TOLERANCE = 0.35
MEAN_TOLERANCE = 0.15

pytestmark = pytest.mark.slow  # the two sharp models run 40 records each (~40 s on one thread)


def args(**kw) -> argparse.Namespace:
    base = {"holdout": 0.25, "seed": 0, "min_questions": 30, "reference": None}
    return argparse.Namespace(**(base | kw))


@pytest.fixture(scope="module")
def sharp(tiny_model_dir_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharp")
    return {q: sharpened(tiny_model_dir_factory(q), root / q) for q in ("f32", "Q4_0")}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal-data") / "requests.jsonl"
    path.write_text("".join(json.dumps({"state": r["state"], "questions": QUESTIONS}) + "\n"
                            for r in demo.requests(N_RECORDS, seed=11)))
    return path


@pytest.fixture(scope="module")
def runs(sharp, data, tmp_path_factory):
    """The sharp f32 and Q4_0 models' logits on the same records (computed once)."""
    from clef_gguf.runtime.model import Clef

    records = list(labelled.read(data))
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for quant, directory in sharp.items():
        out[quant] = predict.run_model(lambda d=directory: Clef.load(d, threads=1), records, root / quant,
                                       label=quant, identity={"model": quant}, with_binding=True,
                                       progress=False)
    return out


def with_targets(run: predict.ModelRun, temperature: float, copies: int = 1, seed: int = 5) -> predict.ModelRun:
    """``run`` with its records repeated ``copies`` times (line numbers continued), each copy
    labelled by its own draws from softmax(logits / temperature)."""
    n = len(run.lines)
    lines = [line | {"id": str(c * n + int(line["id"]))}
             for c in range(copies) for line in with_sampled_targets(run.lines, temperature, seed + c)]
    return predict.ModelRun(run.label, run.directory, lines, run.cost, run.info)


def numbered(n: int) -> list[labelled.LabelledRecord]:
    return [labelled.LabelledRecord(i, None, None) for i in range(n)]


def check_table(table: dict, truth: float) -> None:
    for key in ("noul.2", "choice.3_5", "score.3_5"):
        assert table[key]["source"] == "band", key
        assert table[key]["temperature"] == pytest.approx(truth, rel=TOLERANCE), key
    mean = np.mean([table[t]["temperature"] for t in ("noul", "choice", "score")])
    assert mean == pytest.approx(truth, rel=MEAN_TOLERANCE)


def test_labels_drawn_at_t2_give_t2_and_a_better_holdout(runs, data):
    run = with_targets(runs["f32"], 2.0, COPIES)
    records = numbered(len(run.lines))
    body = calibrate.fitted(run, None, calibrate.split(records, 0.25, 0), args(), data, len(records))
    check_table(body["temperatures"], 2.0)
    assert body["temperatures"]["choice.3_5"]["n"] == 2 * 600
    held = body["fit"]["holdout"]
    assert held["records"] == 200 and held["before"]["labelled"] == 200 * 6
    assert held["after"]["nll"] < held["before"]["nll"] - 0.02  # over-confident by 2: it helps
    assert held["after"]["ece"] < held["before"]["ece"]
    assert body["fit"]["method"] == "nll" and body["bound_to"] == runs["f32"].info["binding"]


def test_labels_drawn_at_t1_leave_t1(runs):
    # calibrated already: the fit may land a hair either side of the held-out NLL (and then be
    # refused, as any fit that does not help); the temperatures themselves stay near 1
    lines = with_targets(runs["f32"], 1.0, COPIES).lines
    check_table(fit.fit_table(calibrate.items(lines, None)), 1.0)


def test_label_free_against_f32_lowers_the_held_out_kl(runs, data):
    records = list(labelled.read(data))
    body = calibrate.fitted(runs["Q4_0"], runs["f32"], calibrate.split(records, 0.25, 0),
                            args(reference="f32"), data, len(records))
    held = body["fit"]["holdout"]
    assert held["after"]["mean_kl"] < held["before"]["mean_kl"]
    assert body["fit"]["method"] == "kl"
    assert body["fit"]["reference"]["model_hash"] == runs["f32"].info["model_hash"]


def test_a_fit_that_makes_the_holdout_worse_is_refused(runs, data):
    records = list(labelled.read(data))
    held = calibrate.split(records, 0.25, 0)
    cold = with_targets(runs["f32"], 0.5).lines
    hot = with_targets(runs["f32"], 4.0).lines
    mixed = [h if int(c["id"]) in held else c for c, h in zip(cold, hot)]
    run = predict.ModelRun("f32", runs["f32"].directory, mixed, runs["f32"].cost, runs["f32"].info)
    with pytest.raises(errors.CalibrationNotBetter, match="held-out nll worse"):
        calibrate.fitted(run, None, held, args(), data, len(records))


def test_calibrate_then_decide_with_the_file(sharp, runs, tmp_path, capsys):
    model = str(sharp["f32"])
    data = tmp_path / "labelled.jsonl"  # the fixture's records, each labelled 5 times at T = 2
    with open(data, "w") as f:
        for line, request in zip(with_targets(runs["f32"], 2.0, 5).lines,
                                 [r for _ in range(5) for r in demo.requests(N_RECORDS, seed=11)]):
            labels = {qid: q["option_ids"][line["targets"][qid]] for qid, q in line["questions"].items()}
            f.write(json.dumps({"state": request["state"], "questions": QUESTIONS, "labels": labels}) + "\n")
    cal = tmp_path / "cal.json"
    # repeated requests are answered from the state cache: 200 records cost about 40 decodes
    assert main(["calibrate", "-m", model, "-d", str(data), "-o", str(cal), "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["version"].startswith("cal-") and json.loads(cal.read_text())["version"] == out["version"]
    assert out["holdout"]["after"]["nll"] < out["holdout"]["before"]["nll"]
    assert out["temperatures"]["choice.3_5"] > 1.3
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"state": "refund", "questions": demo.QUESTIONS}))
    assert main(["decide", "-m", model, "-r", str(request), "--threads", "1", "--calibration", str(cal)]) == 0
    assert json.loads(capsys.readouterr().out)["audit"]["calibration_version"] == out["version"]
    assert main(["decide", "-m", model, "-r", str(request), "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["audit"]["calibration_version"] == "none"
    # eval with the file: the model's directory says which calibration it ran with
    assert main(["eval", "-m", model, "-d", str(data), "-o", str(tmp_path / "eval-cal"), "--threads", "1",
                 "--calibration", str(cal), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["models"][0]["info"]["calibration_version"] == out["version"]
    # refused: another model's weights, a tampered file, overwriting, a second fit on the raw file
    assert main(["decide", "-m", str(sharp["Q4_0"]), "-r", str(request), "--calibration", str(cal)]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "calibration_mismatch"
    body = json.loads(cal.read_text())
    body["temperatures"]["choice"]["temperature"] = 1.0
    (tmp_path / "tampered.json").write_text(json.dumps(body))
    assert main(["decide", "-m", model, "-r", str(request), "--calibration", str(tmp_path / "tampered.json")]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "corrupt_calibration"
    assert main(["calibrate", "-m", model, "-d", str(data), "-o", str(cal)]) == 2
    assert "never overwritten" in json.loads(capsys.readouterr().out)["error"]["message"]
