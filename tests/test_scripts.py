"""The GPU check scripts run here too. ``gpu-check.sh --dry-run`` runs every row's code path on the CPU
(the report's schema, the deadline, the priority order); its install step is checked against a local
bundle; ``gpu_check_nvfp4.py`` asserts what is true of this machine (a CUDA device or not: both branches
assert, neither is skipped)."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script)],
                          capture_output=True, text=True, timeout=timeout)


def cuda_device() -> bool:
    """Whether torch sees a CUDA device, as ``gpu_check_nvfp4.py`` asks."""
    import torch

    return torch.cuda.is_available()


def assert_nvfp4_check(stdout: str, returncode: int, cuda: bool, stderr: str) -> None:
    report = json.loads(stdout)
    if cuda:  # the success report: kernels, the FP4 GEMM probe, agreement, latencies, exit 0
        assert "error" not in report, (report, stderr)
        assert isinstance(report["gpu"], str) and report["gpu"], report
        capability = report["capability"]
        assert len(capability) == 2 and all(isinstance(c, int) for c in capability), report
        assert isinstance(report["native_fp4"], bool), report
        probe = report["scaled_mm_fp4"]
        assert probe == "ran" or probe.startswith("refused: "), report
        kernel = report["kernel"]  # keyed by the W4A4 flag, False and True, as JSON writes them
        assert set(kernel) == {"false", "true"}, report
        assert all(isinstance(k, str) and k for k in kernel.values()), report
        worst = report["tiny_fp32_gpu_vs_cpu_max_abs_dp"]
        assert worst["nvfp4a16"] <= 1e-5 and worst["nvfp4"] <= 5e-3, report
        assert set(report["latency_ms"]) == {"tiny", "qwen08b"}, report
        for preset, schemes in report["latency_ms"].items():
            assert set(schemes) == {"nvfp4a16", "nvfp4"}, (preset, schemes)
            for scheme, t in schemes.items():
                assert 0 < t["min"] <= t["median"] <= t["max"], (preset, scheme, t)
        assert returncode == 0, (report, stderr)
    else:
        assert report == {"error": "no CUDA device"}
        assert returncode == 1


def test_nvfp4_gpu_check_reports_what_this_machine_has():
    cuda = cuda_device()
    print(f"\ngpu_check_nvfp4.py {'with a CUDA device' if cuda else 'without CUDA'}")
    # on a GPU it builds, quantizes and times a 0.8B-shaped release as well: a longer bound
    proc = _run("gpu_check_nvfp4.py", timeout=900 if cuda else 300)
    assert_nvfp4_check(proc.stdout, proc.returncode, cuda, proc.stderr)


ROWS = ["preflight", "parity", "latency", "kernels", "throughput", "pick", "nvfp4"]


def _check(*argv: str, tmp_path: Path, timeout: float = 600, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "report.json"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), *argv, "--report", str(report)],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
    return proc, json.loads(report.read_text())


def test_the_dry_run_runs_every_row_on_the_cpu_into_one_report(tmp_path):
    proc, report = _check("--dry-run", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert report["schema"] == "clef-gguf-gpu-check/1" and report["dry_run"] and report["finished"]
    assert [r["name"] for r in report["rows"]] == ROWS and [r["priority"] for r in report["rows"]] == list(range(1, 8))
    rows = {r["name"]: r for r in report["rows"]}
    assert {r["status"] for r in rows.values()} <= {"passed", "measured"}, rows
    assert rows["parity"]["max_abs_dp"] == 0.0 and rows["parity"]["placed"] == {"gpu_layers": 0, "head_device": "cpu"}
    assert rows["parity"]["packed_vs_one_max_abs_dp"] == 0.0  # the CPU's packing is byte-identical
    first = rows["latency"]["by_tokens"]["64"]
    assert first["head_ms"]["median"] > 0 and first["tower_ms"]["min"] <= first["tower_ms"]["median"]
    assert {(k["weights"], k["attention"], k["n_batch"]) for k in rows["kernels"]["rows"]} >= {
        ("Q4_K_M", "default", 512), ("bf16", "flash-off", 512), ("f16", "default", 2048)}
    assert set(rows["throughput"]["decide_many_per_s"]) == {"1", "4", "16"}
    assert [lv["concurrency"] for lv in rows["throughput"]["serve"]["levels"]] == [1, 4]
    assert rows["pick"]["ratio"] > 0 and rows["nvfp4"]["pytorch_fp32_gpu_vs_cpu_max_abs_dp"] == 0.0
    assert set(rows["nvfp4"]["total_ms"]) == {"nvfp4-gguf", "Q4_K_M", "pytorch-nvfp4a16"}
    assert set(rows["nvfp4"]["pytorch_decisions_per_s"]) == {"pack_1", "packed"}
    bf16 = rows["nvfp4"]["pytorch_bf16_vs_reference_bf16"]
    assert 0 <= bf16["max_abs_dp"] <= 1e-2 and 0 <= bf16["hidden_max_rel"] < 2e-2, bf16


def test_rows_the_deadline_leaves_no_time_for_are_skipped_not_failed(tmp_path):
    proc, report = _check("--dry-run", "--deadline", "7", tmp_path=tmp_path)
    statuses = [r["status"] for r in report["rows"]]
    assert proc.returncode == 0 and report["finished"] and report["failed"] == []
    assert statuses[0] == "passed" and statuses[-1] == "skipped" and "pending" not in statuses
    assert all("deadline" in r["reason"] for r in report["rows"] if r["status"] == "skipped")


def test_a_relative_report_path_is_the_callers_folders(tmp_path):
    """gpu-check.sh runs the check from a scratch folder: a relative --report still lands where it was asked."""
    for argv in (["--report", "here.json"], ["--report=there.json"]):
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--rows", "preflight",
                               *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    for name in ("here.json", "there.json"):
        assert json.loads((tmp_path / name).read_text())["rows"][0]["name"] == "preflight"


def test_a_row_that_fails_is_reported_so_and_fails_the_check(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    crashed = gpu_check.run_row("no-such-row", tmp_path, True, 60)  # the child raises: a failure with its words
    assert crashed["status"] == "failed" and "KeyError" in crashed["reason"]
    monkeypatch.setattr(gpu_check, "run_row", lambda name, work, dry, left:
                        {"status": "failed", "reason": "GPU and CPU disagree"} if name == "parity" else
                        {"status": "passed"})
    report = tmp_path / "r.json"
    assert gpu_check.main(["--dry-run", "--rows", "preflight,parity,pick", "--report", str(report)]) == 1
    data = json.loads(report.read_text())
    assert data["failed"] == ["parity"] and [r["status"] for r in data["rows"]] == ["passed", "failed", "passed"]


def test_the_install_step_takes_the_bundle_and_nothing_from_an_index(tmp_path):
    """A local bundle shaped like ../shared/gpu-bundle: wheels (this project's among them) and the llama.cpp
    tarball; installed into a site folder with --no-index, importable from there."""
    bundle = tmp_path / "bundle"
    (bundle / "whl").mkdir(parents=True)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(bundle / "whl"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    marker = tmp_path / "llama_stub"
    marker.mkdir()
    (marker / "__init__.py").write_text("BUILT_FOR = 'sm_90'\n")
    with tarfile.open(bundle / "llama_cpp_cuda.tar.xz", "w:xz") as tar:
        tar.add(marker, arcname="llama_stub")
    (bundle / "VARIANT").write_text("flash-attention-on\n")
    site = tmp_path / "site"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--install-only", str(bundle)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CLEF_GPU_SITE": str(site), "PIP_INDEX_URL": "http://127.0.0.1:9/none"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(site)
    assert (site / "clef_gguf" / "heads" / "joint.py").is_file() and (site / "llama_stub" / "__init__.py").is_file()
    found = subprocess.run([sys.executable, "-c", "import clef_gguf.pick.speed, llama_stub; print(clef_gguf.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)})
    assert found.stdout.strip().startswith(str(site)), found.stderr
