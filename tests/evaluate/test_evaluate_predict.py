"""One model over the records: the journal, resume after a cut line, the binding of a directory."""

from __future__ import annotations

import json

import pytest

from clef_gguf.core import errors
from clef_gguf.evaluate import demo, predict
from clef_gguf.evaluate import records as labelled


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"id": r["id"], "state": r["state"], "questions": r["questions"],
                         "labels": {"urgent": True}}) for r in demo.requests(3, seed=2)]
    path.write_text("\n".join(lines + ["{broken"]) + "\n")
    return list(labelled.read(path))


def test_resume_recomputes_only_what_the_journal_lacks(tiny_model_dir, data, tmp_path):
    from clef_gguf.runtime.model import Clef

    loads = []

    def load():
        loads.append(1)
        return Clef.load(tiny_model_dir, threads=1)

    out = tmp_path / "m"
    first = predict.run_model(load, data, out, label="f32", identity={"model": "x"}, progress=False)
    assert [line["id"] for line in first.lines] == ["0", "1", "2", "3"]
    assert first.cost.records == 4 and first.info["calibration_version"] == "none"
    assert "error" in first.lines[3] and first.lines[0]["targets"] == {"urgent": 0}
    journal = out / predict.JOURNAL
    raw = journal.read_bytes()
    cut = raw[:raw.rfind(b"\n", 0, len(raw) - 1) + 1]  # the last line lost
    journal.write_bytes(cut + raw[len(cut):len(cut) + 10])  # and half of it written by a crash
    (out / predict.RUN).write_text(json.dumps({"model": "x"}))  # the run never finished
    again = predict.run_model(load, data, out, label="f32", identity={"model": "x"}, progress=False)
    assert again.cost.records == 1 and again.lines == first.lines and len(loads) == 2
    done = predict.run_model(load, data, out, label="f32", identity={"model": "x"}, progress=False)
    assert len(loads) == 2 and done.lines == first.lines  # finished: not loaded again
    with pytest.raises(errors.InvalidValue, match="another run"):
        predict.run_model(load, data, out, label="f32", identity={"model": "y"}, progress=False)
    rows = predict.prediction_rows(done.lines)
    assert [r["record_id"] for r in rows] == ["demo-0", "demo-1", "demo-2"]
    assert predict.counts(done.lines, 4)["failed"] == {"invalid_json": 1}
    assert [p["line"] for p in predict.problems(done.lines)] == [3]
