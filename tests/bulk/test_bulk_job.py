"""``clef-gguf batch`` end to end on the tiny model: formats, errors per record, resume."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulk_helpers import OTHER, SCHEMA, lines, state, write_schema, write_states
from clef_gguf.cli import main
from clef_gguf.runtime.model import Clef

MODEL_FLAGS = ("--threads", "1", "--max-length", "2048")


@pytest.fixture(scope="module")
def clef(tiny_model_dir):
    with Clef.load(tiny_model_dir, threads=1, max_length=2048) as loaded:
        yield loaded


def decided(clef, record_id: str, request: dict) -> dict:
    """What the batch output holds for a request: its id, then the response less
    ``usage.cached_tokens`` (what the state cache held: left out so the output is the input's)."""
    response = clef.decide(request)
    response["usage"].pop("cached_tokens", None)
    return {"id": record_id, **response}


def batch(model, *args: str) -> int:
    return main(["batch", "--model", str(model), *MODEL_FLAGS, *map(str, args)])


def test_shared_schema_with_a_bad_record_in_the_middle(tiny_model_dir, clef, tmp_path, capsys):
    src = write_states(tmp_path / "in.jsonl", 12, bad_at=(5,))
    out = tmp_path / "out.jsonl"
    rc = batch(tiny_model_dir, "-i", src, "-o", out, "-q", write_schema(tmp_path / "q.json"),
               "--window", "4")
    assert rc == 0
    got = lines(out)
    assert [r["id"] for r in got] == [f"inv-{i}" if i != 5 else "5" for i in range(12)]
    assert got[5] == {"id": "5", "error": got[5]["error"]}
    assert got[5]["error"]["code"] == "invalid_json"
    for i in (0, 6, 11):  # the same answers as one decide each, the id beside them
        assert got[i] == decided(clef, f"inv-{i}", {"state": state(i), "questions": SCHEMA})
    assert set(got[0]) == {"id", "model", "answers", "usage", "audit"}  # no warning for the id
    err = capsys.readouterr().err
    assert "11 answered, 1 failed (invalid_json: 1), 0 already done" in err

    # a rerun finds everything done and writes nothing
    assert batch(tiny_model_dir, "-i", src, "-o", out, "-q", tmp_path / "q.json") == 0
    assert lines(out) == got
    assert "0 answered, 0 failed, 12 already done" in capsys.readouterr().err
    # --retry-errors redoes the error record (still an error: the line is still broken)
    assert batch(tiny_model_dir, "-i", src, "-o", out, "-q", tmp_path / "q.json",
                 "--retry-errors") == 0
    again = lines(out)
    assert [r["id"] for r in again] == [r["id"] for r in got if r["id"] != "5"] + ["5"]


def test_full_requests_ids_by_line_and_model_errors(tiny_model_dir, clef, tmp_path, capsys):
    requests = [{"state": state(0), "questions": SCHEMA},
                {"state": state(0), "questions": OTHER},  # same state: decoded once
                {"state": "word " * 3000, "questions": OTHER},  # over the 2048-token window
                {"state": state(1)},  # no questions and no --questions
                {"state": state(1), "questions": OTHER, "options": {"truncate_state": True}}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp_path / "out.jsonl"
    assert batch(tiny_model_dir, "-i", src, "-o", out) == 0
    got = lines(out)
    assert [r["id"] for r in got] == ["0", "1", "2", "3", "4"]
    assert got[2]["error"]["code"] == "context_too_large"
    assert got[3]["error"] == {"code": "missing_field", "message": got[3]["error"]["message"],
                               "field": "questions"}
    for i in (0, 1, 4):
        assert got[i] == decided(clef, str(i), requests[i])
    assert "(context_too_large: 1, missing_field: 1)" in capsys.readouterr().err


def test_parquet_in_and_out_matches_jsonl(tiny_model_dir, tmp_path):
    n = 9
    jsonl_in = write_states(tmp_path / "in.jsonl", n)
    schema = write_schema(tmp_path / "q.json")
    pq.write_table(pa.table({"id": [f"inv-{i}" for i in range(n)],
                             "state": [state(i) for i in range(n)]}), tmp_path / "in.parquet")
    assert batch(tiny_model_dir, "-i", jsonl_in, "-o", tmp_path / "out.jsonl", "-q", schema) == 0
    assert batch(tiny_model_dir, "-i", tmp_path / "in.parquet", "-o", tmp_path / "out.parquet",
                 "-q", schema, "--window", "2") == 0
    assert not (tmp_path / "out.parquet.journal.jsonl").exists()
    import pandas as pd  # what the README shows a pandas user

    df = pd.read_parquet(tmp_path / "out.parquet")
    assert list(df.columns) == ["id", "model", "answers", "usage", "audit", "warnings",
                                "truncated", "error", "error_code"]
    for row, expected in zip(df.to_dict("records"), lines(tmp_path / "out.jsonl")):
        assert row["id"] == expected["id"] and row["model"] == expected["model"]
        for column in ("answers", "usage", "audit"):
            assert json.loads(row[column]) == expected[column]
        assert pd.isna(row["error"]) and not row["truncated"]


def test_duplicate_ids_are_refused_before_any_model_loads(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "state": "x"}\n{"id": "a", "state": "y"}\n')
    out = tmp_path / "out.jsonl"
    rc = main(["batch", "--model", str(tmp_path / "no-such-model"), "-i", str(src), "-o",
               str(out), "-q", str(write_schema(tmp_path / "q.json"))])
    assert rc == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "duplicate_id"
    assert not out.exists()


def test_a_bad_schema_or_a_missing_one_for_parquet_exits_2(tmp_path, capsys):
    (tmp_path / "q.json").write_text('{"q": {"type": "maybe"}}')
    src = write_states(tmp_path / "in.jsonl", 2)
    assert main(["batch", "--model", str(tmp_path), "-i", str(src), "-o",
                 str(tmp_path / "o.jsonl"), "-q", str(tmp_path / "q.json")]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "invalid_question_type"
    pq.write_table(pa.table({"state": ["s"]}), tmp_path / "in.parquet")
    assert main(["batch", "--model", str(tmp_path), "-i", str(tmp_path / "in.parquet"), "-o",
                 str(tmp_path / "o.parquet")]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["field"] == "questions"


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["batch", "--help"])
    text = capsys.readouterr().out
    for flag in ("--input", "--output", "--questions", "--retry-errors", "--truncate-state",
                 "--window", "--log-every", "--engine", "--ray-address", "--replicas",
                 "--threads-per-replica", "--model"):
        assert flag in text
