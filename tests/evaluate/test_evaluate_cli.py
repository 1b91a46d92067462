"""``clef-gguf eval`` on the tiny model: clef-finetune's files, quants side by side, resume, bad
input."""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys

import numpy as np
import pytest
from clef_finetune import metrics as oracle

from clef_gguf.cli import main
from clef_gguf.evaluate import demo

ROW_KEYS = ["record_id", "question_id", "type", "option_ids", "probs", "target"]


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and np.isnan(a):
        return isinstance(b, float) and np.isnan(b)
    return a == b


@pytest.fixture(scope="module")
def data(tiny_model_dir, tmp_path_factory):
    from clef_gguf.runtime.model import Clef

    with Clef.load(tiny_model_dir, threads=1) as clef:
        return demo.write(clef, tmp_path_factory.mktemp("data") / "demo.jsonl", 10, seed=3)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_model_writes_clef_finetunes_rows_and_metrics(tiny_model_dir, data, tmp_path, capsys,
                                                         monkeypatch):
    from clef_gguf.runtime.model import Clef

    out = tmp_path / "eval"
    assert main(["eval", "-m", str(tiny_model_dir), "-d", str(data), "-o", str(out), "--threads", "1"]) == 0
    assert "accuracy" in capsys.readouterr().out
    rows = read_jsonl(out / "predictions.jsonl")
    assert len(rows) == 10 * len(demo.QUESTIONS)
    assert all(list(r) == ROW_KEYS for r in rows)
    records = read_jsonl(data)
    with Clef.load(tiny_model_dir, threads=1) as clef:
        request = {k: v for k, v in records[4].items() if k not in ("id", "labels")}
        probs = clef.probabilities(request)
    mine = [r for r in rows if r["record_id"] == records[4]["id"]]
    assert [r["probs"] for r in mine] == [p.tolist() for p in probs]  # unrounded float32
    assert mine[0]["option_ids"] == ["true", "false"]
    assert mine[1]["option_ids"] == sorted(demo.QUESTIONS["route"]["criteria"])
    metrics = json.loads((out / "metrics.json").read_text())
    assert same({k: metrics[k] for k in ("overall", "per_question")}, oracle.summarize(rows))
    assert set(metrics["per_type"]) == {"noul", "choice", "score"}
    assert metrics["records"]["answered"] == 10 and metrics["records"]["failed"] == {}
    assert (out / "report.md").read_text().startswith("# clef-gguf eval")
    # a rerun resumes: everything is done, so the model is not even loaded
    monkeypatch.setattr(Clef, "load", classmethod(lambda *a, **k: pytest.fail("loaded again")))
    assert main(["eval", "-m", str(tiny_model_dir), "-d", str(data), "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["models"][0]["metrics"]["overall"]["n"] == len(rows)
    assert read_jsonl(out / "predictions.jsonl") == rows


@pytest.mark.slow  # three quants, loaded one after another
def test_quants_side_by_side(tiny_model_dir_factory, data, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the eval extra (test dependency)
    out = tmp_path / "side"
    models = [str(tiny_model_dir_factory(q)) for q in ("f32", "q8_0", "Q4_0")]
    argv = ["eval", "-d", str(data), "-o", str(out), "--threads", "1", "--plots", "--json"]
    for m in models:
        argv += ["-m", m]
    argv += ["--resamples", "200"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    f32, q8, q4 = summary["models"]
    assert f32["is_reference"] and "agreement" not in f32
    assert q8["agreement"]["overall"]["n"] == 10 * len(demo.QUESTIONS)
    assert q8["agreement"]["overall"]["mean_kl"] < q4["agreement"]["overall"]["mean_kl"]
    assert q8["agreement"]["overall"]["top1"] >= q4["agreement"]["overall"]["top1"]
    assert q8["cost"]["tower_bytes"] < f32["cost"]["tower_bytes"]
    assert q4["cost"]["tower_bytes"] < q8["cost"]["tower_bytes"]
    for s in summary["models"]:
        assert s["cost"]["records_per_s"] > 0 and s["cost"]["peak_rss_bytes"] > 0
        assert (out / s["directory"].rsplit("/", 1)[-1] / "predictions.jsonl").exists()
    lo, hi = q4["deltas"]["accuracy"]["ci95"]
    assert lo <= q4["deltas"]["accuracy"]["delta"] <= hi
    report = (out / "report.md").read_text()
    assert "| model | quant |" in report and "top-1 agreement" in report and "Q4_0" in report
    for png in ("reliability.png", "tradeoff.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # the same seed gives the same intervals; resumed, nothing is recomputed
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["models"][2]["deltas"] == q4["deltas"]
    assert main(argv[:-2] + ["--resamples", "200", "--seed", "1"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["models"][2]["deltas"]["nll"]["ci95"] != q4["deltas"]["nll"]["ci95"]


def test_bad_records_and_labels_are_reported_and_the_rest_scored(tiny_model_dir, tmp_path, capsys):
    good = {"state": "refund", "questions": demo.QUESTIONS}
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join([
        json.dumps(good | {"id": "ok", "labels": {"urgent": "true", "route": "billing", "severity": "2"}}),
        "{not json",
        json.dumps(good | {"id": "bad-labels", "labels": {"route": "marketing", "nope": True, "urgent": False}}),
        json.dumps(good | {"id": "media", "images": ["x.png"], "labels": {"urgent": True}}),  # no such file
        json.dumps(good | {"id": "not-object", "labels": "true"}),
        json.dumps({"id": "no-questions", "state": 1, "questions": {}, "labels": {}}),
        json.dumps(good | {"id": "unlabelled"})]) + "\n")
    out = tmp_path / "eval"
    assert main(["eval", "-m", str(tiny_model_dir), "-d", str(src), "-o", str(out), "--threads", "1"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["records"] == {"records": 7, "answered": 3,
                                  "failed": {"invalid_json": 1, "invalid_label": 1, "invalid_media": 1,
                                             "no_questions": 1},
                                  "label_errors": 2, "questions": 9, "labelled_questions": 4}
    rows = read_jsonl(out / "predictions.jsonl")
    assert [(r["record_id"], r["question_id"]) for r in rows] == [
        ("ok", "urgent"), ("ok", "route"), ("ok", "severity"), ("bad-labels", "urgent")]
    problems = read_jsonl(out / "errors.jsonl")
    assert {(p["line"], p["error"]["code"], p["error"]["field"]) for p in problems} == {
        (1, "invalid_json", None), (2, "invalid_label", "labels.route"), (2, "invalid_label", "labels.nope"),
        (3, "invalid_media", "images.0"), (4, "invalid_label", "labels"), (5, "no_questions", "questions")}


def test_refusals(tiny_model_dir_factory, data, tmp_path, capsys, monkeypatch):
    f32, q8 = str(tiny_model_dir_factory("f32")), str(tiny_model_dir_factory("q8_0"))
    out = tmp_path / "eval"
    base = ["eval", "-d", str(data), "-o", str(out), "--threads", "1"]
    assert main(base + ["-m", f32, "-m", q8, "--calibration", "a.json", "--calibration", "b.json",
                        "--calibration", "c.json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["field"] == "calibration"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the eval extra not installed
    assert main(base + ["-m", f32, "--plots"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "missing_dependency" and "clef-gguf[eval]" in error["message"]
    assert not out.exists()  # said before anything ran
    monkeypatch.delitem(sys.modules, "matplotlib")
    assert main(base + ["-m", f32]) == 0
    capsys.readouterr()
    assert main(base + ["-m", q8]) == 2  # another model's results are there: not mixed
    assert "another run" in json.loads(capsys.readouterr().out)["error"]["message"]
    assert main(["eval", "-m", f32, "-d", str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 2
    capsys.readouterr()
    made = tmp_path / "made.jsonl"
    assert main(["eval", "-m", f32, "-d", str(made), "--write-demo-data", "2", "-o", str(tmp_path / "d"),
                 "--threads", "1"]) == 0
    assert [set(r["labels"]) for r in read_jsonl(made)] == [set(demo.QUESTIONS)] * 2
    assert main(["eval", "-m", f32, "-d", str(made), "--write-demo-data", "2", "-o", str(tmp_path / "e")]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--help"])
    assert exc.value.code == 0


def test_a_fine_tune_is_evaluated_with_its_adapter_and_head(tiny_model_dir, tiny_fine_tunes, data, tmp_path,
                                                            capsys):
    """``eval --adapter DIR``: the fine-tune's probabilities and its own model hash, not the base's."""
    from clef_gguf.runtime.model import Clef

    out = tmp_path / "eval-a"
    assert main(["eval", "-m", str(tiny_model_dir), "--adapter", str(tiny_fine_tunes["a"]), "-d", str(data),
                 "-o", str(out), "--threads", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = read_jsonl(out / "predictions.jsonl")
    request = {k: v for k, v in read_jsonl(data)[2].items() if k not in ("id", "labels")}
    with Clef.load(tiny_model_dir, adapters=tiny_fine_tunes["a"], threads=1) as tune:
        probs = tune.probabilities(request)
        assert summary["models"][0]["info"]["model_hash"] == tune.provenance.model_hash
    mine = [r for r in rows if r["record_id"] == read_jsonl(data)[2]["id"]]
    assert [r["probs"] for r in mine] == [p.tolist() for p in probs]


def di_rows(path, long_state: str) -> list[dict]:
    """Decision Index rows of two benchmarks, noul and choice, one row over the window."""
    team = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "payments",
                                                                          "support": "help", "sales": "deals"}}
    rows = []
    for i in range(7):
        rows.append({"id": f"home-{i}", "family": "Home appliances", "state": f"ticket {i}: the fridge hums",
                     "questions": {"urgent": {"type": "noul"}, "team": team},
                     "expected": {"urgent": i % 2 == 0, "team": ["billing", "support", "sales"][i % 3]},
                     "metadata": {"source": "synthetic"}, "scoring": {"metric": "accuracy"},
                     "_evaluation": {"split": "test"}})
    rows[2]["state"] = long_state
    for i in range(4):
        rows.append({"id": f"fc-{i}", "track": "Forecasts", "state": f"will it rain on day {i}?",
                     "questions": {"rain": {"type": "noul"}}, "expected": {"rain": i < 2},
                     "scoring": {"metric": "brier_vs_forecast"}})
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def test_decision_index_rows_per_benchmark_and_quant_then_pick(tiny_model_dir_factory, tmp_path, capsys,
                                                               monkeypatch):
    pytest.importorskip("matplotlib")
    f32, q8 = tiny_model_dir_factory("f32"), tiny_model_dir_factory("q8_0")
    quants = tmp_path / "quants"  # one directory, one .gguf per quant next to the head files
    quants.mkdir()
    for name in ("joint_head.safetensors", "joint_head_config.json", "tokenizer.json"):
        shutil.copy(f32 / name, quants / name)
    shutil.copy(f32 / "tower-f32.gguf", quants / "tower-f32.gguf")
    shutil.copy(q8 / "tower-q8_0.gguf", quants / "tower-q8_0.gguf")
    rows = tmp_path / "selected-rows.jsonl.gz"
    di_rows(rows, "the customer writes again and again " * 500)
    out = tmp_path / "di"
    argv = ["eval", str(rows), "--quants", "F32,Q8_0", "-m", str(quants), "-o", str(out), "--threads", "1",
            "--max-length", "1024", "--resamples", "100", "--plots", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["suite"]["benchmarks"] == ["Forecasts", "Home appliances"]
    ref, q = summary["models"]
    home, fc = ref["benchmarks"]["Home appliances"], ref["benchmarks"]["Forecasts"]
    assert (home["rows"], home["answered"], fc["rows"], fc["answered"]) == (7, 6, 4, 4)
    assert home["coverage"]["value"] == 6 / 7 and home["accuracy"]["n"] == 12 and fc["accuracy"]["n"] == 4
    assert [(u["row"], u["id"], u["code"]) for u in home["unanswered"]] == [(3, "home-2", "context_too_large")]
    assert set(home["macro_f1"]["keys"]) <= {"true", "false", "billing", "support", "sales"}
    assert fc["not_computed"] == ["brier_vs_forecast"] and home["not_computed"] == []
    for b in (home, fc):
        lo, hi = b["accuracy"]["ci95"]
        assert lo <= b["accuracy"]["value"] <= hi and b["case_exact"]["n"] == b["answered"]
    deltas = q["benchmark_deltas"]["Home appliances"]
    assert deltas["agreement"]["n"] == 12 and deltas["rows_compared"] == 6 and "delta" in deltas["accuracy"]
    report = (out / "report.md").read_text()
    assert "## Per benchmark" in report and "row 3 (id home-2): context_too_large" in report
    assert "brier_vs_forecast" in report and "Not computed" in report
    assert (out / "benchmarks.png").read_bytes()[:4] == b"\x89PNG"
    # pick takes the table as evidence: the quants the eval compared, judged per benchmark too
    from machine_helpers import box
    from clef_gguf.pick import command as pick

    monkeypatch.setattr(pick, "probe", lambda **_: box(ram=64))
    parser = argparse.ArgumentParser()
    pick.add_arguments(parser)
    assert pick.run(parser.parse_args(["--no-probe", "--eval", str(out), "--json"])) == 0
    picked = json.loads(capsys.readouterr().out)["recommendation"]
    assert picked["quant"] == "Q8_0" and "Q8_0" in picked["reason"]


@pytest.mark.parametrize("argv, field", [
    (["--quants", "Q8_0,Q4_0", "-m", "a", "-m", "b"], "quants"),
    (["--quants", "Q3_K"], "quants"),  # the directory holds no such .gguf
    ([], "model"),
])
def test_quants_and_rows_are_refused_when_they_cannot_be_meant(tiny_model_dir, tmp_path, capsys, argv, field):
    rows = tmp_path / "rows.jsonl.gz"
    di_rows(rows, "short")
    if argv == ["--quants", "Q3_K"]:
        argv = argv + ["-m", str(tiny_model_dir)]
    assert main(["eval", str(rows), "-o", str(tmp_path / "o"), *argv]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["field"] == field


def test_truncate_state_is_refused_with_suite_rows(tiny_model_dir, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl.gz"
    di_rows(rows, "short")
    assert main(["eval", str(rows), "-m", str(tiny_model_dir), "-o", str(tmp_path / "o"), "--truncate-state"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["field"] == "truncate_state" and "never cut" in error["message"]
    assert not (tmp_path / "o").exists()  # refused before any model ran


def test_a_malformed_row_stops_eval_with_its_row_and_field(tiny_model_dir, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    good = di_rows(tmp_path / "x.gz", "short")
    bad = dict(good[1], expected={"team": "marketing"})
    rows.write_text("\n".join(json.dumps(r) for r in (good[0], bad)) + "\n")
    assert main(["eval", str(rows), "-m", str(tiny_model_dir), "-o", str(tmp_path / "o")]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["field"] == "expected.team" and "row 2" in error["message"]
    assert main(["eval", str(rows), "-d", str(rows), "-m", str(tiny_model_dir), "-o", str(tmp_path / "o")]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["field"] == "data"
    assert main(["eval", "-m", str(tiny_model_dir), "-o", str(tmp_path / "o")]) == 2  # no data at all
