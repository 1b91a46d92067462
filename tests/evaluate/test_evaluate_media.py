"""Labelled records with images and videos in ``eval`` and ``calibrate``, on the tiny model (it has a
vision tower): asked like text records, their paths relative to the data file, their probabilities
the ones ``Clef.decide`` gives; a picture that cannot be read, or a model that cannot see, fails its
record with its error, and nothing is skipped."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from clef_gguf.cli import main
from clef_gguf.evaluate import demo
from clef_gguf.formats.files import VISION_CONFIG
from clef_gguf.runtime.model import Clef

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "media"))
from media_helpers import encode, picture  # noqa: E402

LABELS = {"urgent": True, "route": "billing", "severity": 2}
FRAMES = {"do_sample_frames": False}  # frames given as images: the reference's requirement


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def pictures(data: Path) -> None:
    (data / "pics").mkdir(parents=True)
    for i, (w, h) in enumerate([(32, 24), (24, 40), (16, 16), (16, 16)]):
        (data / "pics" / f"p{i}.png").write_bytes(encode(picture(w, h, seed=i)))


def absolute(request: dict, data: Path) -> dict:
    """``request`` with its paths made absolute, as a caller anywhere sends it to ``Clef.decide``."""
    out = dict(request)
    if "images" in out:
        out["images"] = [str(data / p) for p in out["images"]]
    if "videos" in out:
        out["videos"] = [[[str(data / p) for p in video[0]]] for video in out["videos"]]
    return out


def request(state: str, **media) -> dict:
    return {"state": state, "questions": demo.QUESTIONS, **media}


RECORDS = [
    ("one", request("A photo of a receipt.", images=["pics/p0.png"]), LABELS),
    ("two", request("Two photos, one seen before.", images=["pics/p0.png", "pics/p1.png"]), {"urgent": False}),
    ("video", request("A short clip.", videos=[[["pics/p2.png", "pics/p3.png"]]], media_kwargs=FRAMES),
     {"route": "support", "severity": 0}),
    ("text", request("No picture at all."), {"severity": 1}),
]


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    """A data file in its own folder with its pictures beside it; the working directory elsewhere, so a
    path read from it would not be found."""
    folder = tmp_path / "data"
    pictures(folder)
    lines = [dict(r, id=rid, labels=labels) for rid, r, labels in RECORDS]
    lines.append(request("A picture that is not there.", id="missing", images=["pics/nope.png"], labels=LABELS))
    path = folder / "records.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    monkeypatch.chdir(tmp_path)
    return path


def test_eval_scores_records_with_pictures_as_decide_answers_them(tiny_model_dir, data, tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", "-m", str(tiny_model_dir), "-d", str(data), "-o", str(out), "--threads", "1"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["records"] == {"records": 5, "answered": 4, "failed": {"invalid_media": 1}, "label_errors": 0,
                                  "questions": 12, "labelled_questions": 7}
    assert metrics["overall"]["n"] == 7
    assert "skipped" not in (out / "report.md").read_text()
    [problem] = read_jsonl(out / "errors.jsonl")
    assert (problem["record_id"], problem["error"]["code"], problem["error"]["field"]) == \
        ("missing", "invalid_media", "images.0")
    rows = read_jsonl(out / "predictions.jsonl")
    assert [(r["record_id"], r["question_id"]) for r in rows] == \
        [(rid, q) for rid, _, labels in RECORDS for q in demo.QUESTIONS if q in labels]
    folder = data.parent
    with Clef.load(tiny_model_dir, threads=1) as clef:
        for rid, req, _ in RECORDS:
            direct = absolute(req, folder)
            probs = dict(zip(demo.QUESTIONS, clef.probabilities(direct)))
            decided = clef.decide(direct)["answers"]
            for row in (r for r in rows if r["record_id"] == rid):
                assert row["probs"] == probs[row["question_id"]].tolist()  # unrounded float32, bit for bit
                answer = decided[row["question_id"]]
                by_id = dict(zip(row["option_ids"], row["probs"]))
                if answer["type"] == "noul":
                    assert answer["noul"] == round(by_id["true"], 4)
                else:
                    assert answer["probabilities"] == {k: round(by_id[k], 4) for k in answer["probabilities"]}


def test_a_record_an_earlier_version_skipped_is_computed_on_resume(tiny_model_dir, data, tmp_path):
    out = tmp_path / "eval"
    argv = ["eval", "-m", str(tiny_model_dir), "-d", str(data), "-o", str(out), "--threads", "1"]
    assert main(argv) == 0
    rows = read_jsonl(out / "predictions.jsonl")
    journal = out / "records.jsonl"
    lines = read_jsonl(journal)
    lines[0] = {"id": "0", "record_id": "one", "skipped": "media"}  # what eval wrote before pictures ran
    journal.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(argv) == 0
    assert read_jsonl(out / "predictions.jsonl") == rows
    assert json.loads((out / "metrics.json").read_text())["records"]["answered"] == 4


def test_a_model_without_a_vision_tower_fails_those_records_and_answers_the_rest(tiny_model_dir, data, tmp_path):
    blind = tmp_path / "blind"
    shutil.copytree(tiny_model_dir, blind)
    (blind / VISION_CONFIG).unlink()
    out = tmp_path / "eval-blind"
    assert main(["eval", "-m", str(blind), "-d", str(data), "-o", str(out), "--threads", "1"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["records"]["answered"] == 1 and metrics["records"]["failed"] == {"unsupported": 4}
    fields = {p["record_id"]: (p["error"]["code"], p["error"]["field"]) for p in read_jsonl(out / "errors.jsonl")}
    assert fields == {"one": ("unsupported", "images"), "two": ("unsupported", "images"),
                      "video": ("unsupported", "videos"), "missing": ("unsupported", "images")}


def test_calibrate_fits_on_records_with_pictures(tiny_model_dir, tmp_path, monkeypatch):
    folder = tmp_path / "cal-data"
    pictures(folder)
    lines = [dict(request(f"Ticket {i} with a photo.", images=[f"pics/p{i % 3}.png"]), id=f"r{i}", labels=LABELS)
             for i in range(6)]
    data = folder / "records.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    monkeypatch.chdir(tmp_path)
    work, target = tmp_path / "work", tmp_path / "cal.json"
    # Too few questions for a temperature of their own: every one stays 1.0, so the held-out check
    # passes whatever the random tiny head does, and the file says what was fitted on.
    assert main(["calibrate", "-m", str(tiny_model_dir), "-d", str(data), "-o", str(target), "--work", str(work),
                 "--min-questions", "1000", "--threads", "1"]) == 0
    fitted = json.loads(target.read_text())["fit"]
    assert fitted["holdout"]["records"] == 2 and fitted["fit_items"] == 4 * 3  # the other 4 records' labels
    assert fitted["holdout"]["before"]["labelled"] == 2 * 3
    journal = read_jsonl(work / "model" / "records.jsonl")
    assert len(journal) == 6 and all("questions" in line for line in journal)
    with Clef.load(tiny_model_dir, threads=1) as clef:
        for line, record in zip(journal, lines):
            req = absolute({k: v for k, v in record.items() if k not in ("id", "labels")}, folder)
            got = [q["probs"] for q in line["questions"].values()]
            assert got == [p.tolist() for p in clef.probabilities(req)]
