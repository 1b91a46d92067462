"""The local engine (``bulk/local.py``) on a fake model: output records in input order, a record
the reader could not read keeps its error, a record that fails in the model fails alone."""

from clef_gguf.bulk.local import results
from clef_gguf.bulk.records import Record
from engine_helpers import Packing, requests


def test_records_in_order_each_failure_in_its_place():
    reqs = requests("b", "a", "boom", "crash", "a", "b", "c")
    unreadable = {"error": {"code": "invalid_json", "message": "not JSON", "field": None}}
    records = [Record(i, f"r{i}", r) for i, r in enumerate(reqs)]
    records.insert(2, Record(99, "bad-line", None, unreadable))
    model = Packing(pack=4)
    out = list(results(model, iter(records), window=4))
    assert [o["id"] for o in out] == [r.id for r in records]
    assert out[2] == {"id": "bad-line", **unreadable}
    assert out[3]["error"]["message"] == "RuntimeError: tower exploded"
    assert out[4]["error"]["message"] == "ValueError: tokenizer exploded"
    assert [o.get("answers") for o in out] == ["b-0", "a-1", None, None, None, "a-4", "b-5", "c-6"]
    # windows of 4 records (the unreadable one counts), each one packed run in state order; the
    # one with "boom" in it failed, and its requests ran again one at a time
    assert model.groups == [["a-1", "b-0", "boom-2"], ["a-4", "b-5", "c-6"]]
    assert model.ran[:3] == ["a-1", "b-0", "boom-2"]
