"""The GPU check script runs here too: on this CPU-only build it reports no backend and exits 1."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_reports_a_cpu_only_build():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")],
                          capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["backends"] == [] and report["gpu_layers"] == 0
    assert report["max_abs_dp"] == 0.0  # both runs on the CPU: the same numbers
    assert proc.returncode == 1
    assert (ROOT / "scripts" / "gpu-check.sh").read_text().count("GGML_CUDA=on") == 1


def test_nvfp4_gpu_check_says_there_is_no_cuda():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_nvfp4.py")],
                          capture_output=True, text=True, timeout=300)
    assert json.loads(proc.stdout) == {"error": "no CUDA device"}
    assert proc.returncode == 1
    assert "gpu_check_nvfp4.py" in (ROOT / "scripts" / "gpu-check.sh").read_text()
