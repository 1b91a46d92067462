"""``clef-gguf bench-server`` starts a real server, checks every answer's bytes, reports levels."""

import json
import subprocess


def test_bench_server_small_run(tiny_model_dir):
    proc = subprocess.run(["clef-gguf", "bench-server", "--model", str(tiny_model_dir),
                           "--concurrency", "1", "4", "--requests", "8", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert [lv["concurrency"] for lv in out["levels"]] == [1, 4]
    assert all(lv["ok"] == 8 and lv["failed"] == 0 for lv in out["levels"])


def test_bench_server_refuses_nonsense():
    proc = subprocess.run(["clef-gguf", "bench-server", "--url", "http://127.0.0.1:9",
                           "--concurrency", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # argparse refuses it, naming the flag
    assert "--concurrency" in proc.stderr and "at least 1" in proc.stderr
