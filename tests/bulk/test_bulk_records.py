"""Reading batch inputs and resuming outputs, without a model."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulk_helpers import SCHEMA
from clef_gguf.core import errors
from clef_gguf.bulk import records
from clef_gguf.core.errors import CorruptOutput, DuplicateId, InvalidInput
from clef_gguf.bulk.output import Output, read_journal


def test_jsonl_ids_schema_and_unreadable_lines(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "state": "s0"}\n'
                   "\n"  # blank: not a record, but it keeps its number
                   '{"state": "s2", "questions": {"q": {"type": "noul"}}}\n'
                   "{oops\n"
                   '{"id": 7, "state": "s4"}\n'
                   '[1, 2]\n'
                   '{"id": true, "state": "s6"}\n')
    got = list(records.read(src, "jsonl", SCHEMA))
    assert [r.index for r in got] == [0, 2, 3, 4, 5, 6]
    assert [r.id for r in got] == ["a", "2", "3", "7", "5", "6"]
    assert got[0].request == {"state": "s0", "questions": SCHEMA}  # the id is the record's
    assert got[1].request["questions"] == {"q": {"type": "noul"}}  # a line's own questions win
    assert got[2].error["error"]["code"] == "invalid_json"
    assert got[4].error["error"]["code"] == "invalid_value"
    assert got[5].error["error"]["field"] == "id"


def test_duplicate_ids_are_refused_with_both_lines(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "x", "state": 1}\n{"state": 2}\n{"id": "1", "state": 3}\n')
    with pytest.raises(DuplicateId) as caught:
        records.index_ids(src, "jsonl", SCHEMA)
    assert caught.value.code == "duplicate_id" and "lines 1 and 2" in caught.value.message


def test_a_bad_schema_fails_up_front(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"q": {"type": "maybe"}}))
    with pytest.raises(errors.InvalidQuestionType):
        records.load_schema(path)
    path.write_text("[1]")
    with pytest.raises(errors.InvalidValue):
        records.load_schema(path)


def test_parquet_rows(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", None, "c"], "state": ["s0", "s1", "s2"]}), src)
    got = list(records.read(src, "parquet", SCHEMA))
    assert [r.id for r in got] == ["a", "1", "c"]
    assert got[1].request == {"state": "s1", "questions": SCHEMA}
    assert records.index_ids(src, "parquet", SCHEMA) == {"a": 0, "1": 1, "c": 2}
    with pytest.raises(errors.MissingField):
        records.read(src, "parquet", None)
    pq.write_table(pa.table({"text": ["x"]}), src)
    with pytest.raises(InvalidInput):
        list(records.read(src, "parquet", SCHEMA))
    src.write_bytes(b"not parquet")
    with pytest.raises(InvalidInput):
        list(records.read(src, "parquet", SCHEMA))


def test_a_line_cut_by_a_crash_is_dropped_and_a_foreign_line_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "a", "answers": {}}\n{"id": "b", "answ')
    assert [r["id"] for r in read_journal(out)] == ["a"]
    assert out.read_bytes() == b'{"id": "a", "answers": {}}\n'
    out.write_bytes(b'{"id": "a", "answers": {}}\nhello\n')
    with pytest.raises(CorruptOutput):
        read_journal(out)


def test_retry_errors_drops_error_lines_first(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "answers": {}}\n{"id": "b", "error": {"code": "x"}}\n')
    assert Output(out, "jsonl").open() == {"a": False, "b": True}
    output = Output(out, "jsonl", retry_errors=True)
    assert output.open() == {"a": False}
    output.close()
    assert [r["id"] for r in read_journal(out)] == ["a"]


def test_parquet_output_is_assembled_in_input_order(tmp_path):
    out = tmp_path / "out.parquet"
    output = Output(out, "parquet")
    assert output.open() == {}
    output.write({"id": "b", "model": "m", "answers": {"q": 1}, "usage": {"input_tokens": 3},
                  "audit": {}})
    output.write({"id": "a", "error": {"code": "invalid_json", "message": "m", "field": None}})
    output.close({"a": 0, "b": 1})
    assert not (tmp_path / "out.parquet.journal.jsonl").exists()
    table = pq.read_table(out).to_pylist()
    assert [r["id"] for r in table] == ["a", "b"]
    assert table[0]["error_code"] == "invalid_json" and table[0]["answers"] is None
    assert json.loads(table[1]["answers"]) == {"q": 1} and table[1]["truncated"] is False
    assert Output(out, "parquet").open() == {"a": True, "b": False}  # resume from the table
