"""``clef-gguf bench``: runs on the tiny model, reports every stage; bad arguments are refused."""

import json
import subprocess


def test_bench_reports_every_stage(tiny_model_dir):
    proc = subprocess.run(["clef-gguf", "bench", "--model", str(tiny_model_dir), "--tokens", "400",
                           "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out["median_ms"]) == {"encode", "tower", "lexical", "head", "answer", "total"}
    assert out["tokens"] <= 400 and out["questions"]


def test_bench_refuses_nonsense(tiny_model_dir):
    proc = subprocess.run(["clef-gguf", "bench", "--model", str(tiny_model_dir), "--repeat", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2  # argparse refuses it before any model loads, naming the flag
    assert "--repeat" in proc.stderr and "at least 1" in proc.stderr


def test_bench_versus_reports_ratios(tiny_model_dir):
    """The side-by-side benchmarks as a smoke test: they run and report; no timing is asserted."""
    for mode in ("prefill", "reuse"):
        proc = subprocess.run(["clef-gguf", "bench", "--model", str(tiny_model_dir), "--versus", mode,
                               "--rounds", "2", "--tokens", "300"], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["versus"] == mode and out["rounds"] == 2
        assert out["ratio_min"] <= out["ratio_median"] <= out["ratio_max"]
        assert out["a_ms_median"] > 0 and out["b_ms_median"] > 0


def test_bench_versus_transformers(tiny_model_dir, tiny_release):
    proc = subprocess.run(["clef-gguf", "bench", "--model", str(tiny_model_dir), "--versus",
                           "transformers", "--release", str(tiny_release), "--rounds", "2",
                           "--tokens", "300"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["versus"] == "transformers" and out["ratio_min"] <= out["ratio_median"]
    missing = subprocess.run(["clef-gguf", "bench", "--model", str(tiny_model_dir), "--versus",
                              "transformers"], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and json.loads(missing.stdout)["error"]["field"] == "release"


def test_bench_versus_packed(tiny_model_dir):
    """``--versus packed`` (decisions, and the tower alone on synthetic prompts) runs and reports the
    ratio, the packed decodes and how far the answers are apart; no timing is asserted."""
    for extra in (["--tokens", "300", "--mixed"], ["--synthetic", "--tokens", "100"]):
        proc = subprocess.run(["clef-gguf", "bench", "--model", str(tiny_model_dir), "--versus", "packed",
                               "--pack", "2", "--requests", "4", "--rounds", "2", *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["versus"] == "packed" and out["pack"] == 2 and out["requests"] == 4
        assert out["ratio_min"] <= out["ratio_median"] <= out["ratio_max"]
        assert out["max_abs_dh"] == 0.0 and out.get("max_abs_dp", 0.0) == 0.0
        assert "2" in out["packed_decodes_per_round"]


def test_bench_picture_reports_the_vision_share(tiny_model_dir, tmp_path):
    """``--picture``: the decision carries one picture, the split has the vision stage and the picture's
    share of each cold run (no timing is asserted, only that the share is one)."""
    proc = subprocess.run(["clef-gguf", "bench", "--model", str(tiny_model_dir), "--tokens", "400",
                           "--repeat", "2", "--picture", "64"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "vision" in out["median_ms"] and out["median_ms"]["vision"] > 0
    assert out["picture"] == 64 and out["picture_tokens"] > 0 and out["tokens"] <= 400
    share = out["picture_share"]
    assert 0 < share["min"] <= share["median"] <= share["max"] < 1
    text_only = tmp_path / "text-only"
    text_only.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file() and not f.name.startswith("vision"):
            (text_only / f.name).symlink_to(f)
    refused = subprocess.run(["clef-gguf", "bench", "--model", str(text_only), "--picture", "64"],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and json.loads(refused.stdout)["error"]["field"] == "picture"
