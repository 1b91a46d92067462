"""Reading clef-finetune's labelled JSONL and turning labels into option indices, without a model."""

from __future__ import annotations

import json

import pytest
from clef_finetune import data as oracle

from clef_gguf.evaluate import records
from clef_gguf.pipeline.request import parse_request

QUESTIONS = {"urgent": {"type": "noul"},
             "route": {"type": "choice", "criteria": {"sales": "s", "billing": "b", "Zeta": "z"}},
             "severity": {"type": "score", "criteria": ["none", "minor", "major"]}}


def test_lines_ids_labels_media_and_unreadable(tmp_path):
    src = tmp_path / "data.jsonl"
    src.write_text("\n".join([
        json.dumps({"id": "a", "state": 1, "questions": QUESTIONS, "labels": {"urgent": True}}),
        "",
        json.dumps({"state": 2, "questions": QUESTIONS}),  # no labels: asked, not scored
        "{oops",
        json.dumps({"id": 7, "state": 3, "questions": QUESTIONS, "labels": ["x"]}),
        json.dumps({"state": 4, "questions": QUESTIONS, "images": ["a.png"], "labels": {}}),
        "[1]"]) + "\n")
    got = list(records.read(src))
    assert [r.index for r in got] == [0, 2, 3, 4, 5, 6]
    assert got[0].record_id == "a" and got[0].labels == {"urgent": True}
    assert "labels" not in got[0].request and "id" not in got[0].request
    assert got[1].record_id is None and got[1].labels == {} and got[1].error is None
    assert got[2].error["error"]["code"] == "invalid_json"
    assert got[3].record_id == 7 and got[3].error["error"]["code"] == "invalid_label"
    assert got[4].error is None and got[4].request["images"] == ["a.png"]  # asked like the rest
    assert got[5].error["error"]["code"] == "invalid_value"


def test_missing_file_is_a_clear_error(tmp_path):
    from clef_gguf.core import errors

    with pytest.raises(errors.InvalidInput):
        list(records.read(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize("qid,label", [
    ("urgent", True), ("urgent", False), ("urgent", "TRUE"), ("urgent", "false"),
    ("route", "sales"), ("route", "Zeta"), ("severity", 0), ("severity", 2), ("severity", "1"),
    ("severity", " 2 ")])
def test_labels_map_to_the_oracles_index(qid, label):
    request = parse_request({"state": None, "questions": QUESTIONS})
    targets, problems = records.targets(request, {qid: label})
    assert problems == []
    assert targets == {qid: oracle.label_index(QUESTIONS[qid], label)}
    question = next(q for q in request.questions if q.id == qid)
    assert records.option_ids(question) == oracle.option_ids(QUESTIONS[qid])


@pytest.mark.parametrize("qid,label", [
    ("urgent", "yes"), ("urgent", 1), ("route", "marketing"), ("route", 0), ("severity", 3),
    ("severity", -1), ("severity", True), ("severity", "²"), ("severity", 1.0), ("missing", True)])
def test_bad_labels_are_reported_and_the_rest_kept(qid, label):
    request = parse_request({"state": None, "questions": QUESTIONS})
    targets, problems = records.targets(request, {qid: label, "urgent" if qid != "urgent" else "route":
                                                  True if qid != "urgent" else "sales"})
    assert len(targets) == 1
    assert [p["error"]["code"] for p in problems] == ["invalid_label"]
    assert problems[0]["error"]["field"] == f"labels.{qid}"
