"""The nvfp4 backend on a CUDA machine: which kernel runs, GPU vs CPU agreement, and latency.

    python scripts/gpu_check nvfp4-backend

The nvfp4 backend's own check, apart from the GPU check's rows (tests/test_scripts.py runs it). For the
tiny and a Qwen3.5-0.8B-shaped random release, each quantized to NVFP4A16 and NVFP4 (W4A4) with our
converter: the median latency of one decision on the GPU (alternating the two schemes, 7 rounds), and
for the tiny model max |dp| between the GPU and the CPU, like for like: both in fp32
(``nvfp4_dtype="fp32"``; bf16 activations round to other FP4 codes, a different computation, not a wrong
kernel). It also records whether torch's FP4 GEMM is refused on this GPU (expected before Blackwell).
Prints one JSON report; exit 1 when CUDA is absent or the GPU and CPU disagree past the scheme's bar
(:func:`bar`: NVFP4A16 ``limits.NVFP4_FP32_MAX_DP``; W4A4 ``limits.NVFP4_W4A4_FP32_MAX_DP``: its
activations' FP4 rounding flips where fp32 sums differ in their last bits).
"""

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from clef_gguf import Clef
from clef_gguf.convert.nvfp4 import quantize_release
from clef_gguf.convert.synthetic.tiny import build_release
from clef_gguf.tower.nvfp4 import kernels
from clef_gguf.convert.samples import SAMPLE_REQUESTS
from clef_gguf.core.limits import NVFP4_FP32_MAX_DP, NVFP4_W4A4_FP32_MAX_DP
from gpu_check.nvfp4 import run_cpu_half

ROUNDS = 7
REQUEST = {**SAMPLE_REQUESTS[2]}  # ~400 tokens


def scaled_mm_probe() -> str:
    """What torch's FP4 GEMM says on this GPU (an error before Blackwell)."""
    try:
        a = torch.zeros(128, 64, dtype=torch.uint8, device="cuda").view(torch.float4_e2m1fn_x2)
        b = torch.zeros(128, 64, dtype=torch.uint8, device="cuda").view(torch.float4_e2m1fn_x2)
        s = torch.ones(128 * 8, dtype=torch.float8_e4m3fn, device="cuda")
        torch._scaled_mm(a, b.t(), s, s, out_dtype=torch.bfloat16)
        return "ran"
    except Exception as exc:  # the refusal is the finding
        return f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def bar(scheme: str) -> float:
    """The largest fp32 |dp| between the GPU and the CPU for ``scheme`` (``core.limits``)."""
    return NVFP4_W4A4_FP32_MAX_DP if scheme == "nvfp4" else NVFP4_FP32_MAX_DP


def cpu_probabilities(model_dir: Path) -> list[list[float]]:
    """fp32 on the CPU in a process of its own (the nvfp4 row's CPU half): transformers binds
    flash-linear-attention's Triton kernels at its first import, and they take no CPU tensors."""
    proc = run_cpu_half(model_dir)
    proc.check_returncode()
    return json.loads(proc.stdout.strip().splitlines()[-1])["probabilities"]


def latency(model_dir: Path) -> list[float]:
    with Clef.load(model_dir, gpu_layers="all", state_cache_mb=0, max_length=4096) as clef:
        clef.decide(REQUEST)  # warm-up: CUDA context, kernels
        out = []
        for _ in range(ROUNDS):
            torch.cuda.synchronize()
            start = time.perf_counter()
            clef.decide(REQUEST)
            torch.cuda.synchronize()
            out.append((time.perf_counter() - start) * 1e3)
        return out


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    dev = torch.device("cuda")
    report = {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
              "native_fp4": kernels.native_fp4(dev), "scaled_mm_fp4": scaled_mm_probe(),
              "kernel": {s: kernels.kernel_name(dev, s) for s in (False, True)}, "latency_ms": {}}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for preset in ("tiny", "qwen08b"):
            release = build_release(Path(tmp) / preset / "release", preset=preset)
            dirs = {s: quantize_release(release, Path(tmp) / preset / s, scheme=s) for s in ("nvfp4a16", "nvfp4")}
            if preset == "tiny":
                worst = {}
                for scheme, d in dirs.items():
                    with Clef.load(d, gpu_layers="all", state_cache_mb=0, nvfp4_dtype="fp32") as gpu:
                        on_gpu = [np.concatenate(gpu.probabilities(r)) for r in SAMPLE_REQUESTS]
                    on_cpu = cpu_probabilities(d)
                    worst[scheme] = max(float(np.abs(a - np.asarray(b)).max()) for a, b in zip(on_gpu, on_cpu))
                report["tiny_fp32_gpu_vs_cpu_max_abs_dp"] = worst
                ok = ok and all(worst[s] <= bar(s) for s in worst)
            times = {s: latency(d) for s, d in dirs.items()}
            report["latency_ms"][preset] = {
                s: {"median": round(statistics.median(t), 2), "min": round(min(t), 2), "max": round(max(t), 2)}
                for s, t in times.items()}
    print(json.dumps(report, indent=2))
    return 0 if ok else 1
