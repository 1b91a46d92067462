"""``clef-gguf decide`` with images: a local path in the request is read relative to the working directory
(as the reference's ``load_image`` reads it), not to the request file; a missing file exits 2 naming the
field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from clef_gguf import Clef

sys.path.insert(0, str(Path(__file__).resolve().parent / "media"))
from media_helpers import encode, picture  # noqa: E402

TIMEOUT_S = 120.0
QUESTIONS = {"cat": {"type": "noul", "instructions": "Is there a cat?"},
             "color": {"type": "choice", "criteria": {"red": None, "green": None, "blue": None}}}


def _decide(model: Path, request_file: Path, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "clef_gguf.cli", "decide", "--model", str(model), "--threads",
                             "1", "--max-length", "2048", "--request", str(request_file)],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_decide_reads_a_relative_path_from_the_working_directory(tiny_model_dir, tmp_path):
    work, requests = tmp_path / "work", tmp_path / "requests"
    (work / "pics").mkdir(parents=True)
    requests.mkdir()
    png = encode(picture(40, 24, 7))
    (work / "pics" / "a.png").write_bytes(png)
    (requests / "pics").mkdir()
    (requests / "pics" / "a.png").write_bytes(encode(picture(40, 24, 8)))  # beside the request: not read
    good = {"state": "A picture.", "questions": QUESTIONS, "images": ["pics/a.png"]}
    missing = dict(good, images=["pics/nope.png"])
    (requests / "good.json").write_text(json.dumps(good))
    (requests / "missing.json").write_text(json.dumps(missing))
    runs = [_decide(tiny_model_dir, requests / name, work) for name in ("good.json", "missing.json")]
    try:
        (out, err), (bad_out, bad_err) = (p.communicate(timeout=TIMEOUT_S) for p in runs)
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
                p.wait(TIMEOUT_S)
    assert runs[0].returncode == 0, err
    with Clef.load(tiny_model_dir, threads=1, max_length=2048) as clef:
        want = clef.decide(dict(good, images=[str(work / "pics" / "a.png")]))
        beside = clef.decide(dict(good, images=[str(requests / "pics" / "a.png")]))
    got = json.loads(out)
    assert got["answers"] == want["answers"] != beside["answers"]
    assert got["usage"]["input_tokens"] == want["usage"]["input_tokens"]
    assert runs[1].returncode == 2, bad_err
    error = json.loads(bad_out)["error"]
    assert (error["code"], error["field"]) == ("invalid_media", "images.0")
    assert "no such image file" in error["message"] and "images.0" in bad_err
