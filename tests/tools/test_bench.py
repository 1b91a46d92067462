"""``clef-gguf bench``: runs on the tiny model, reports every stage; bad arguments are refused."""

import json
import subprocess


def test_bench_reports_every_stage(tiny_model_dir):
    proc = subprocess.run(["clef-gguf", "bench", "--model", str(tiny_model_dir), "--tokens", "400",
                           "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out["median_ms"]) == {"encode", "tower", "lexical", "head", "total"}
    assert out["tokens"] <= 400 and out["questions"]


def test_bench_refuses_nonsense(tiny_model_dir):
    proc = subprocess.run(["clef-gguf", "bench", "--model", str(tiny_model_dir), "--repeat", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"]["code"] == "invalid_value"
