"""The GPU check scripts run here too, and each test asserts what is true of this machine, found
the way the script itself finds it: with a GPU backend in the llama.cpp build (``gpu_check.py``)
or a CUDA device for torch (``gpu_check_nvfp4.py``), the script's success report and exit 0;
without, the CPU-only report and exit 1. Both branches assert; neither is skipped. The test prints
which one ran."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script)],
                          capture_output=True, text=True, timeout=timeout)


def llama_gpu_backends() -> list[str]:
    """The GPU backends of the installed llama.cpp build, as ``gpu_check.py`` reads them."""
    from clef_gguf.models import machine

    return list(machine.llama_backends())


def cuda_device() -> bool:
    """Whether torch sees a CUDA device, as ``gpu_check_nvfp4.py`` asks."""
    import torch

    return torch.cuda.is_available()


def assert_gpu_check(report: dict, returncode: int, backends: list[str], stderr: str) -> None:
    assert report["backends"] == backends, report  # the script sees the build this test sees
    if backends:  # a GPU build: every layer offloaded, GPU and CPU agree, exit 0
        assert report["gpu_layers"] == -1, report
        assert 0.0 <= report["max_abs_dp"] <= 1e-3, report
        assert set(report["seconds"]) == {"cpu", "gpu"}, report
        assert all(s >= 0 for s in report["seconds"].values()), report
        assert returncode == 0, (report, stderr)
    else:  # a CPU-only build
        assert report["backends"] == [] and report["gpu_layers"] == 0
        assert report["max_abs_dp"] == 0.0  # both runs on the CPU: the same numbers
        assert returncode == 1


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
        assert 0.0 <= report["tiny_gpu_vs_cpu_max_abs_dp"] <= 0.05, report
        assert set(report["latency_ms"]) == {"tiny", "qwen08b"}, report
        for preset, schemes in report["latency_ms"].items():
            assert set(schemes) == {"nvfp4a16", "nvfp4"}, (preset, schemes)
            for scheme, t in schemes.items():
                assert 0 < t["min"] <= t["median"] <= t["max"], (preset, scheme, t)
        assert returncode == 0, (report, stderr)
    else:
        assert report == {"error": "no CUDA device"}
        assert returncode == 1


def test_gpu_check_reports_what_this_build_has():
    backends = llama_gpu_backends()
    print(f"\ngpu_check.py on a {'GPU build (' + ', '.join(backends) + ')' if backends else 'CPU-only build'}")
    proc = _run("gpu_check.py", timeout=300)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert_gpu_check(report, proc.returncode, backends, proc.stderr)
    assert (ROOT / "scripts" / "gpu-check.sh").read_text().count("GGML_CUDA=on") == 1


def test_nvfp4_gpu_check_reports_what_this_machine_has():
    cuda = cuda_device()
    print(f"\ngpu_check_nvfp4.py {'with a CUDA device' if cuda else 'without CUDA'}")
    # on a GPU it builds, quantizes and times a 0.8B-shaped release as well: a longer bound
    proc = _run("gpu_check_nvfp4.py", timeout=900 if cuda else 300)
    assert_nvfp4_check(proc.stdout, proc.returncode, cuda, proc.stderr)
    assert "gpu_check_nvfp4.py" in (ROOT / "scripts" / "gpu-check.sh").read_text()
