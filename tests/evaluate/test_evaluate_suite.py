"""``evaluate.suite``: Decision Index rows read as they are (``.jsonl.gz`` or ``.jsonl``), what is sent and
what is kept back, and a malformed row refused with its row number and field."""

from __future__ import annotations

import gzip
import json

import pytest

from clef_gguf.core import errors
from clef_gguf.evaluate import records as labelled
from clef_gguf.evaluate import suite

ROUTE = {"type": "choice", "instructions": "Which team?",
         "criteria": {"billing": "payments", "support": "help", "sales": "deals"}}


def di_row(i: int, family: str = "Home appliances", **extra) -> dict:
    return {"id": f"r{i}", "family": family, "track": "choice", "state": f"ticket {i}: the fridge hums",
            "questions": {"urgent": {"type": "noul"}, "team": ROUTE},
            "expected": {"urgent": i % 2 == 0, "team": "support"},
            "metadata": {"source": "synthetic"}, "scoring": {"metric": "accuracy", "secondary_metrics": ["ndcg@10"]},
            "_evaluation": {"split": "test"}, **extra}


def write(path, rows, gz=False) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)


@pytest.mark.parametrize("name, gz", [("selected-rows.jsonl.gz", True), ("added-rows.jsonl.gz", True),
                                      ("rows.jsonl", False)])
def test_rows_are_read_as_they_are_and_only_state_and_questions_are_sent(tmp_path, name, gz):
    rows = [di_row(0), di_row(1, family="Forecasts", track=None), {**di_row(2), "family": None}]
    write(tmp_path / name, [{k: v for k, v in r.items() if v is not None} for r in rows], gz)
    assert suite.is_suite(tmp_path / name)
    got = suite.read(tmp_path / name)
    assert [r.request for r in got.records] == [{"state": r["state"], "questions": r["questions"]} for r in rows]
    assert [r.labels for r in got.records] == [r["expected"] for r in rows]
    assert [r.record_id for r in got.records] == ["r0", "r1", "r2"]
    assert got.benchmarks == {0: "Home appliances/choice", 1: "Forecasts", 2: "choice"}
    assert got.not_computed == {"Home appliances/choice": ["ndcg@10"], "Forecasts": ["ndcg@10"],
                                "choice": ["ndcg@10"]}  # accuracy is computed: not listed


def test_clef_finetune_files_are_not_suites(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"state": "x", "questions": {}, "labels": {}}) + "\n")
    assert not suite.is_suite(tmp_path / "a.jsonl") and not suite.is_suite(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("change, field, words", [
    (lambda r: r.pop("state"), "state", "missing"),
    (lambda r: r.pop("questions"), "questions", "missing"),
    (lambda r: r.update(questions={"q": {"type": "maybe"}}), "questions.q.type", "row 2"),
    (lambda r: r.update(expected=None), "expected", "an object"),
    (lambda r: r.update(expected={"nope": True}), "expected.nope", "names no question"),
    (lambda r: r.update(expected={"team": "marketing"}), "expected.team", "not one of its options"),
    (lambda r: r.update(expected={"urgent": "perhaps"}), "expected.urgent", "true or false"),
    (lambda r: (r.pop("family"), r.pop("track")), "family", "names its benchmark"),
    (lambda r: r.update(family=""), "family", "non-empty"),
])
def test_a_malformed_row_is_refused_with_its_row_number_and_field(tmp_path, change, field, words):
    bad = di_row(1)
    change(bad)
    write(tmp_path / "rows.jsonl", [di_row(0), bad, di_row(2)])
    with pytest.raises(errors.InvalidInput) as exc:
        suite.read(tmp_path / "rows.jsonl")
    assert exc.value.field == field and "row 2" in exc.value.message and words in exc.value.message


def test_a_line_that_is_no_json_object_and_a_broken_gz(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps(di_row(0)) + "\n\n[1, 2]\n")
    with pytest.raises(errors.InvalidInput, match="row 3: row: a JSON object"):
        suite.read(tmp_path / "rows.jsonl")
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(b"x" * 100)[:20])
    with pytest.raises(errors.InvalidInput) as exc:
        suite.read(tmp_path / "rows.jsonl.gz")
    assert exc.value.field == "data"


def test_a_corrupt_deflate_stream_is_refused_naming_the_file(tmp_path):
    damaged = bytearray(gzip.compress("".join(json.dumps(di_row(i)) + "\n" for i in range(50)).encode()))
    damaged[12:30] = bytes(b ^ 0xFF for b in damaged[12:30])  # the header stands, the deflate data does not
    path = tmp_path / "selected-rows.jsonl.gz"
    path.write_bytes(damaged)
    for read in (suite.read, lambda p: list(labelled.read(p))):
        with pytest.raises(errors.InvalidInput) as exc:
            read(path)
        assert exc.value.field == "data" and str(path) in exc.value.message and "corrupt" in exc.value.message
    assert not suite.is_suite(path)  # the labelled reader then says what is wrong with it


def test_a_suite_is_told_by_its_rows_not_by_gz(tmp_path):
    finetune = {"id": "c1", "state": "x", "questions": {"urgent": {"type": "noul"}}, "labels": {"urgent": True}}
    write(tmp_path / "labelled.jsonl.gz", [finetune], gz=True)
    assert not suite.is_suite(tmp_path / "labelled.jsonl.gz")
    assert [r.labels for r in labelled.read(tmp_path / "labelled.jsonl.gz")] == [{"urgent": True}]
    write(tmp_path / "bare.jsonl", [{k: v for k, v in di_row(0).items() if k != "expected"}])
    assert suite.is_suite(tmp_path / "bare.jsonl")  # names its benchmark: its missing expected is then said
    with pytest.raises(errors.InvalidInput, match="row 1: expected"):
        suite.read(tmp_path / "bare.jsonl")
