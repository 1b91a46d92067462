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


def test_answers_are_held_to_bytes_on_a_cpu_and_to_a_tolerance_where_asked():
    """Byte-identical stays the CPU's promise; a tolerance (CUDA's default) lets packed answers differ in
    the last digits, never in their shape."""
    from clef_gguf.core.limits import GPU_MAX_DP as GPU_TOLERANCE
    from clef_gguf.tools.bench_server import default_tolerance, same_answer

    def answer(p: float, choice: str = "a") -> bytes:
        return json.dumps({"answers": {"q": {"choice": choice, "probabilities": {"a": p, "b": 1 - p}}}},
                          sort_keys=True).encode()

    assert same_answer(answer(0.5), answer(0.5), 0.0)
    assert not same_answer(answer(0.50001), answer(0.5), 0.0)
    assert same_answer(answer(0.50001), answer(0.5), GPU_TOLERANCE)
    assert not same_answer(answer(0.5002), answer(0.5), GPU_TOLERANCE)
    assert not same_answer(answer(0.5, "b"), answer(0.5), GPU_TOLERANCE)  # a changed choice is no rounding
    # where the server runs decides, not whether this client process sees CUDA
    assert default_tolerance({"gpu_layers": 0, "head_device": "cpu"}) == 0.0
    assert default_tolerance({"gpu_layers": 0, "head_device": "cuda:0"}) == GPU_TOLERANCE
    assert default_tolerance({"gpu_layers": 33, "head_device": "cpu"}) == GPU_TOLERANCE
    assert default_tolerance({"status": "ok"}) == 0.0  # a server that does not say: byte-identical


def test_tokens_pads_the_requests_and_a_bad_tolerance_is_refused(tiny_model_dir):
    proc = subprocess.run(["clef-gguf", "bench-server", "--model", str(tiny_model_dir), "--concurrency", "2",
                           "--requests", "4", "--tokens", "1000", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert 950 <= out["input_tokens"] <= 1050 and out["levels"][0]["ok"] == 4
    bad = subprocess.run(["clef-gguf", "bench-server", "--url", "http://127.0.0.1:9", "--tolerance", "2"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--tolerance" in bad.stderr and "between 0 and 1" in bad.stderr
