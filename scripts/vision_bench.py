"""CPU time of the PyTorch vision tower for one image at Clef-Flash 9B's vision shape. Prints one JSON report.

    python scripts/vision_bench.py [--size 448] [--runs 5] [--threads 2] [--dtypes float32,bfloat16]

The tower is built in memory with random weights at Qwen3.5-9B's ``vision_config`` (27 blocks, hidden 1152,
MLP 4304, 16 heads, patch 16, temporal patch 2, merge 2, 2304 position embeddings, output 4096 wide): the
time depends on the shapes, not on the values. One square image of SIZE pixels is grid 1 x SIZE/16 x SIZE/16
(448: 784 patches, 196 tokens). Each dtype: one warm-up, then RUNS timed ``embed`` calls; the report gives
the median and the range in seconds. ``matmul_gflops_fp32`` is what one fp32 matmul of a block's size got
from the CPU at the start (on a shared machine, how much of it this run had). Random weights: evidence
about cost only.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from clef_gguf.vision import VisionConfig, VisionModel, VisionTower
from clef_gguf.vision.model import rope_inv_freq

FLASH_9B = VisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                        temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=2304,
                        out_hidden_size=4096)
SEED = 0


def random_tower(config: VisionConfig, dtype: torch.dtype, threads: int) -> VisionTower:
    """A tower of ``config``'s shape with seeded weights: N(0, 0.02) matrices, unit norms, zero biases."""
    with torch.device("meta"):
        model = VisionModel(config)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = rope_inv_freq(config)
    model.to(dtype).requires_grad_(False).eval()
    return VisionTower(model, source=Path("random"), threads=threads)


def measure(tower: VisionTower, size: int, runs: int) -> dict:
    c = tower.config
    side = size // c.patch_size
    grid = torch.tensor([[1, side, side]])
    pixel_values = torch.randn(side * side, c.patch_dim, generator=torch.Generator().manual_seed(SEED))
    tower.embed(pixel_values, grid)  # warm-up: first-call allocations and kernel selection
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        out = tower.embed(pixel_values, grid)
        seconds.append(time.perf_counter() - start)
    return {"median_s": round(statistics.median(seconds), 3), "min_s": round(min(seconds), 3),
            "max_s": round(max(seconds), 3), "runs": runs, "patches": side * side, "tokens": out.shape[0],
            "finite": bool(torch.isfinite(out).all())}


def matmul_gflops(threads: int, repeats: int = 20) -> float:
    """fp32 GFLOP/s of one block-MLP-sized matmul now: how much of the CPU this run actually got."""
    gen = torch.Generator().manual_seed(SEED)
    a, b = torch.randn(784, 1152, generator=gen), torch.randn(1152, 4304, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a @ b
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(before)
    return round(2 * 784 * 1152 * 4304 * repeats / seconds / 1e9, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=448, help="image side in pixels (multiple of 32)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args(argv)
    if args.size % (FLASH_9B.patch_size * FLASH_9B.spatial_merge_size):
        parser.error("--size must be a multiple of 32 (one merged token covers 32 x 32 pixels)")
    report: dict = {"shape": "Clef-Flash 9B vision tower (random weights)", "config": FLASH_9B.__dict__,
                    "image": f"{args.size}x{args.size}", "threads": args.threads,
                    "cpu": platform.processor() or platform.machine(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
                    "matmul_gflops_fp32": matmul_gflops(args.threads)}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        tower = random_tower(FLASH_9B, dtype, args.threads)
        report.setdefault("parameters", sum(p.numel() for p in tower.model.parameters()))
        print(f"vision_bench: {name}", file=sys.stderr, flush=True)
        report[name] = measure(tower, args.size, args.runs)
        print(f"vision_bench: {name} {json.dumps(report[name])}", file=sys.stderr, flush=True)
        del tower
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
