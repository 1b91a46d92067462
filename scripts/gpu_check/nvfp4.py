"""The GPU check's nvfp4 row: one checkpoint three ways, and the PyTorch backend like for like.

On a 0.8B-shaped release (dry run: tiny) quantized to NVFP4A16 by our converter: the NVFP4 GGUF through
llama.cpp, Q4_K_M (the release quantized by llama.cpp) and the PyTorch NVFP4 backend, side by side at
~466 tokens: latency, and each llama.cpp file's max |dp| against the backend over the sample requests
(the target, reported: the NVFP4 GGUF within ``limits.NVFP4_GGUF_TARGET_DP`` of it). Then the backend
like for like: fp32 on the GPU against fp32 on the CPU, the CPU half (:func:`cpu_half`) in a process of
its own where flash-linear-attention and causal-conv1d are hidden (transformers binds their Triton/CUDA
kernels when it is first imported; they take no CPU tensors), bar ``limits.NVFP4_FP32_MAX_DP`` with the
same kernels on both sides or ``limits.NVFP4_FLA_FP32_MAX_DP`` through fla; and bf16 on the device
against transformers' own model on the same dequantized weights (``tower.nvfp4.reference``; bar
``limits.NVFP4_BF16_MAX_DP``).

    python scripts/gpu_check nvfp4-cpu-half CHECKPOINT   # the CPU half: one JSON line (probabilities, kernels)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from clef_gguf.core.limits import NVFP4_BF16_MAX_DP, NVFP4_FLA_FP32_MAX_DP, NVFP4_FP32_MAX_DP, NVFP4_GGUF_TARGET_DP
from gpu_check import command
from gpu_check.common import latency_by_length, placement, tokens
from gpu_check.report import record

HIDDEN = ("fla", "causal_conv1d")  # packages whose kernels the CPU half must not bind


def _probabilities(model: Path, **load: Any) -> tuple[list[list[float]], dict]:
    from clef_gguf import Clef
    from clef_gguf.convert.samples import SAMPLE_REQUESTS

    with Clef.load(model, state_cache_mb=0, **load) as clef:
        probs = [np.concatenate(clef.probabilities(r)).tolist() for r in SAMPLE_REQUESTS]
        return probs, getattr(clef.tower, "linear_kernels", {})


def cpu_half(argv: list[str]) -> int:
    """The backend in fp32 on the CPU, fla and causal-conv1d hidden before transformers is imported."""
    for name in HIDDEN:
        sys.modules[name] = None  # type: ignore[assignment]  # import fails: transformers' reference code
    probs, kernels = _probabilities(Path(argv[0]), gpu_layers=0, head_device="cpu", nvfp4_dtype="fp32")
    print(json.dumps({"probabilities": probs, "linear_kernels": kernels}))
    return 0


def run_cpu_half(checkpoint: Path) -> subprocess.CompletedProcess:
    """:func:`cpu_half` on ``checkpoint`` in a process of its own (its JSON line is the last of stdout)."""
    return subprocess.run(command("nvfp4-cpu-half", str(checkpoint)), capture_output=True, text=True, timeout=900)


def _max_dp(a: list[list[float]], b: list[list[float]]) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b))


def nvfp4(work: Path, dry: bool) -> dict:
    from clef_gguf.convert.nvfp4 import quantize_release
    from clef_gguf.convert.nvfp4_to_gguf import convert_checkpoint
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.synthetic.tiny import build_release

    preset = "tiny" if dry else "qwen08b"
    t0 = time.perf_counter()
    release = build_release(work / f"{preset}-release", preset=preset)
    checkpoint = quantize_release(release, work / f"{preset}-nvfp4a16", scheme="nvfp4a16")
    models = {"pytorch-nvfp4a16": checkpoint,
              "nvfp4-gguf": convert_checkpoint(checkpoint, work / f"{preset}-nvfp4-gguf"),
              "Q4_K_M": convert_release(release, work / f"{preset}-q4", outtype="Q4_K_M")}
    record("models_s", round(time.perf_counter() - t0, 1))
    first = tokens(dry)[0]
    times = {name: latency_by_length(path, dry, (first,), key=f"latency/{name}/")[str(first)]["total_ms"]
             for name, path in models.items()}
    probs = {name: _probabilities(path, **placement(dry))[0] for name, path in models.items()}
    vs_backend = {name: record(f"max_abs_dp_vs_pytorch/{name}", _max_dp(probs[name], probs["pytorch-nvfp4a16"]))
                  for name in ("nvfp4-gguf", "Q4_K_M")}
    gpu_fp32, gpu_kernels = _probabilities(checkpoint, nvfp4_dtype="fp32", **placement(dry))
    proc = run_cpu_half(checkpoint)
    if proc.returncode != 0:
        return {"status": "failed", "reason": f"the CPU half: exit {proc.returncode}: {proc.stderr[-1500:]}"}
    cpu = json.loads(proc.stdout.strip().splitlines()[-1])
    dp = record("pytorch_fp32_gpu_vs_cpu_max_abs_dp", _max_dp(gpu_fp32, cpu["probabilities"]))
    kernels = {"gpu": gpu_kernels, "cpu": cpu["linear_kernels"]}
    # the reference code on both sides: the same fp32 math (NVFP4_FP32_MAX_DP); another kernel on the GPU
    # (fla's Triton, whose fp32 dot products may run in TF32) is another computation: NVFP4_FLA_FP32_MAX_DP
    bar = NVFP4_FP32_MAX_DP if kernels["gpu"] == kernels["cpu"] else NVFP4_FLA_FP32_MAX_DP
    bf16 = record("pytorch_bf16_vs_reference_bf16", _bf16_vs_reference(release, checkpoint, dry))
    ok = dp <= bar and bf16["max_abs_dp"] <= NVFP4_BF16_MAX_DP
    return {"status": "passed" if ok else "failed", "preset": preset, "tokens": first, "total_ms": times,
            "max_abs_dp_vs_pytorch": vs_backend, "gguf_target": NVFP4_GGUF_TARGET_DP,
            "gguf_within_target": vs_backend["nvfp4-gguf"] <= NVFP4_GGUF_TARGET_DP,
            "pytorch_fp32_gpu_vs_cpu_max_abs_dp": dp, "fp32_bar": bar, "linear_kernels": kernels,
            "pytorch_bf16_vs_reference_bf16": bf16, "pytorch_decisions_per_s": _packing(checkpoint, dry)}


def _bf16_vs_reference(release: Path, checkpoint: Path, dry: bool) -> dict[str, float]:
    """The backend in bf16 against transformers' model in bf16 on the same dequantized weights, on the
    same device, over the sample requests: max |dp| (both hidden states through our head) and the hidden
    states' max |difference| relative to their largest value."""
    import torch

    from clef_gguf import Clef
    from clef_gguf.convert.samples import SAMPLE_REQUESTS
    from clef_gguf.formats import files
    from clef_gguf.tower.nvfp4 import reference
    from clef_gguf.tower.nvfp4.checkpoint import Checkpoint

    ref = reference.reference_model(release, Checkpoint(checkpoint / files.CHECKPOINT_CONFIG),
                                    dtype=torch.bfloat16, device="cpu" if dry else "cuda")
    worst_dp = worst_hidden = 0.0
    with Clef.load(checkpoint, state_cache_mb=0, nvfp4_dtype="bf16", **placement(dry)) as clef:
        for request in SAMPLE_REQUESTS:
            enc = clef.prepare(request).encoded
            ours, theirs = clef.tower.hidden_states(enc.ids), reference.reference_hidden_states(ref, enc.ids)
            p = [clef.flat_probabilities(enc, h) for h in (ours, theirs)]
            worst_dp = max(worst_dp, float(np.abs(p[0] - p[1]).max()))
            worst_hidden = max(worst_hidden, float(np.abs(ours - theirs).max() / max(1.0, np.abs(theirs).max())))
    return {"max_abs_dp": worst_dp, "hidden_max_rel": worst_hidden}


def _packing(checkpoint: Path, dry: bool) -> dict[str, Any]:
    """The PyTorch backend's decisions/s (its default dtype) over distinct ~466-token requests, one
    prompt per forward against its packing policy (16 per forward on CUDA; the dry run packs 4)."""
    from clef_gguf import Clef
    from clef_gguf.tools.workload import sized_request

    count = 6 if dry else 32
    rates: dict[str, Any] = {}
    with Clef.load(checkpoint, state_cache_mb=0, **placement(dry)) as clef:
        base = sized_request(clef, 100 if dry else tokens(dry)[0])
        requests = [{**base, "state": f"{i}: {base['state']}"} for i in range(count)]
        list(clef.decide_many(requests[:2]))  # warm-up
        for name, pack in (("pack_1", 1), ("packed", 4 if dry else None)):
            start = time.perf_counter()
            answers = list(clef.decide_many(requests, pack=pack))
            seconds = time.perf_counter() - start
            if any("error" in a for a in answers):
                return {"error": f"{name}: {answers[0]}"[:500], **rates}
            rates[name] = record(f"pytorch_decisions_per_s/{name}", round(count / seconds, 2))
    return rates
