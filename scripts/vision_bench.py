"""The vision tower's CPU engines side by side at Clef-Flash 9B's vision shape, and their cost in answers.

Prints one JSON report.

    python scripts/vision_bench.py [--size 448] [--rounds 5] [--threads 2]
                                   [--engines exact,int8,...] [--parity] [--no-timing]

Timing. Each candidate engine gets its own tower built in memory with the same seeded random weights at
Qwen3.5-9B's ``vision_config`` (27 blocks, hidden 1152, MLP 4304, 16 heads, patch 16, temporal patch 2,
merge 2, 2304 position embeddings, output 4096 wide): the time depends on the shapes, not on the values.
One square image of SIZE pixels is grid 1 x SIZE/16 x SIZE/16 (448: 784 patches, 196 tokens). After one
warm-up call each, every round times one ``embed`` call per engine, the order reversed every other round
(a shared machine's load drifts: alternating keeps the comparison fair); the report gives each engine's
median and range in seconds, and its speed-up over ``exact`` (the median of the per-round ratios, and
their range). ``rows`` is each engine's output against exact's on that image (random weights: the
size of the error, not of any release's). ``matmul_gflops_fp32``: what one fp32 matmul of a block's size
got from the CPU at the start (on a shared machine, how much of it this run had).

Candidates (``--engines``; the shipped ones are ``clef_gguf.vision.engines``'s):
  exact           fp32 PyTorch, the module as built (the reference's numerics; the default engine): oneDNN's
                  fp32 Linear kernel, SDPA's fused CPU attention
  exact-before    exact as it was before those two: ``F.linear`` (MKL's sgemm), SDPA on 3-D (its math path)
  exact-mkl       exact with ``F.linear`` (MKL's sgemm) for every Linear, the fused attention kept
  exact-flush     exact with ``torch.set_flush_denormal(True)`` around the call
  exact-nomkldnn  exact with ``torch.backends.mkldnn`` off
  int8            the shipped int8 engine (blocks' Linear layers: per-row int8 weights, 8-bit activations
                  with VNNI, 7-bit without; the rest as exact)
  int8-tensor     int8 with one weight scale per tensor
  int8-rr         int8 with 7-bit activations (``reduce_range``), i.e. ``torch.ao.quantization.quantize_dynamic``
                  of the blocks as it is
  bf16            the module in bfloat16
  ort             ONNX Runtime (CPU) on the exact module exported at this one grid (``torch.onnx.export``,
                  TorchScript exporter); needs ``onnxruntime`` and ``onnx``, not in the requirements
  ort-int8        ``ort`` through ``onnxruntime.quantization.quantize_dynamic`` (every MatMul, int8 weights)

``--parity``: the shipped engines' answers on the tiny test releases (``convert.synthetic.tiny.build_release``, vision
tower and all, converted to f32): the same picture requests (images of several sizes and aspect ratios,
one that resizes, two at once, a JSON state, a 4-frame video) decided with each engine, max |dp| per
option against ``exact``, and whether the argmax agrees wherever exact's margin is over 0.01. ``moved``:
what another picture does to the same request (how much the pixels matter on these releases: little on
the releases as built, whose vision weights are ~0.02; ``+strong`` redraws them at O(1) scale).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import io
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from clef_gguf.convert.synthetic.big import FLASH_VISION
from clef_gguf.vision import VisionConfig, VisionModel, VisionTower, engines

FLASH_9B = VisionConfig(**FLASH_VISION, out_hidden_size=4096)
SEED = 0
Embed = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def random_tower(config: VisionConfig, dtype: torch.dtype, threads: int, engine: str = "exact") -> VisionTower:
    return VisionTower.random(config, dtype, threads, engine, seed=SEED)


# ------------------------------------------------------------------ candidates
@contextlib.contextmanager
def flush_denormal() -> Iterator[None]:
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _wrapped(tower: VisionTower, context: Callable[[], contextlib.AbstractContextManager]) -> Embed:
    def embed(pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        with context():
            return tower.embed(pixel_values, grid)
    return embed


@contextlib.contextmanager
def previous_kernels(*, attention_3d: bool) -> Iterator[None]:
    """Every ``model.Linear`` on ``F.linear`` (MKL's sgemm) while in this block, as before oneDNN's kernel;
    with ``attention_3d``, attention's SDPA called on [heads, N, head_dim] too (its unfused math path), as
    before. Patches the classes, so a tower built once serves these candidates too (weights shared)."""
    import torch.nn.functional as F

    from clef_gguf.vision import model as vision_model

    def linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def attention(self: vision_model.Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  frames: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)
        q, k = vision_model.apply_rope(q, cos, sin), vision_model.apply_rope(k, cos, sin)
        out = [F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
               for qi, ki, vi in zip(q.split(frames), k.split(frames), v.split(frames))]
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(n, -1))

    saved = vision_model.Linear.forward, vision_model.Attention.forward
    vision_model.Linear.forward = linear  # type: ignore[method-assign]
    if attention_3d:
        vision_model.Attention.forward = attention  # type: ignore[method-assign]
    try:
        yield
    finally:
        vision_model.Linear.forward, vision_model.Attention.forward = saved  # type: ignore[method-assign]


def _int8_variant(config: VisionConfig, threads: int, **options: bool) -> Embed:
    tower = random_tower(config, torch.float32, threads)
    engines.quantize_blocks(tower.model, **options)
    return tower.embed


class AtThisGrid(torch.nn.Module):
    """The tower's forward at one fixed grid: what the ONNX export traces."""

    def __init__(self, model: VisionModel, grid: torch.Tensor) -> None:
        super().__init__()
        self.model, self.grid = model, grid

    def forward(self, px: torch.Tensor) -> torch.Tensor:
        return self.model(px, self.grid)


def export_onnx(config: VisionConfig, grid: torch.Tensor, pixel_values: torch.Tensor, work: Path,
                quantized: bool) -> None:
    """``work/vision.onnx`` (and ``vision-int8.onnx``): run in a child process, whose exporter's and
    quantizer's copies of the weights (~16 GB at the 9B's shape) go when it exits."""
    import warnings

    from onnxruntime.quantization import QuantType, quantize_dynamic

    tower = random_tower(config, torch.float32, 1)
    # F.linear for the exporter (it cannot trace oneDNN's op); the arithmetic is the same
    with warnings.catch_warnings(), torch.no_grad(), previous_kernels(attention_3d=False):
        warnings.simplefilter("ignore")  # the tracer's notes about .tolist(): the grid is fixed on purpose
        torch.onnx.export(AtThisGrid(tower.model, grid), (pixel_values,), str(work / "vision.onnx"), dynamo=False,
                          input_names=["pixel_values"], output_names=["embeddings"])
    del tower
    if quantized:
        quantize_dynamic(str(work / "vision.onnx"), str(work / "vision-int8.onnx"), weight_type=QuantType.QInt8)


def _ort(grid: torch.Tensor, threads: int, path: Path) -> Embed:
    import onnxruntime as ort  # optional: only these candidates need it

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    fixed_grid = grid.clone()

    def embed(px: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        assert torch.equal(g, fixed_grid), "the ONNX export holds one grid"
        return torch.from_numpy(session.run(None, {"pixel_values": px.numpy()})[0])
    return embed


_EXACT: dict[tuple[VisionConfig, int], VisionTower] = {}


def shared_exact(config: VisionConfig, threads: int) -> VisionTower:
    """One exact tower for every candidate that only changes how it is called (1.8 GB at the 9B's shape)."""
    if (config, threads) not in _EXACT:
        _EXACT[config, threads] = random_tower(config, torch.float32, threads)
    return _EXACT[config, threads]


def candidate(name: str, config: VisionConfig, threads: int, grid: torch.Tensor, pixel_values: torch.Tensor,
              work: Path) -> Embed:
    if name == "exact":
        return shared_exact(config, threads).embed
    if name == "int8":
        return random_tower(config, torch.float32, threads, engine=name).embed
    if name in ("exact-before", "exact-mkl"):
        return _wrapped(shared_exact(config, threads), lambda: previous_kernels(attention_3d=name == "exact-before"))
    if name == "exact-flush":
        return _wrapped(shared_exact(config, threads), flush_denormal)
    if name == "exact-nomkldnn":
        return _wrapped(shared_exact(config, threads), lambda: torch.backends.mkldnn.flags(enabled=False))
    if name == "int8-tensor":
        return _int8_variant(config, threads, per_channel=False)
    if name == "int8-rr":
        return _int8_variant(config, threads, per_channel=False, reduce_range=True)
    if name == "bf16":
        tower = shared_exact(config, threads)
        return VisionTower(copy.deepcopy(tower.model).to(torch.bfloat16), source=tower.source, threads=threads).embed
    if name in ("ort", "ort-int8"):
        return _ort(grid, threads, work / ("vision.onnx" if name == "ort" else "vision-int8.onnx"))
    raise SystemExit(f"vision_bench: unknown engine {name!r}")


def rows_error(got: torch.Tensor, want: torch.Tensor) -> dict:
    d = (got.float() - want).abs()
    return {"rel_fro": float(f"{float(d.norm() / want.norm()):.3g}"),
            "max_abs_over_max": float(f"{float(d.max() / want.abs().max()):.3g}")}


def timing(names: list[str], size: int, rounds: int, threads: int) -> dict:
    c = FLASH_9B
    side = size // c.patch_size
    grid = torch.tensor([[1, side, side]])
    pixel_values = torch.randn(side * side, c.patch_dim, generator=torch.Generator().manual_seed(SEED))
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="vision-bench-") as work:
        if {"ort", "ort-int8"} & set(names):
            import importlib.util
            import multiprocessing

            if not all(importlib.util.find_spec(m) for m in ("onnxruntime", "onnx")):
                raise SystemExit("vision_bench: the ort candidates need onnxruntime and onnx "
                                 "(pip install onnxruntime onnx; not in the requirements)")

            print("vision_bench: exporting to ONNX (a child process)", file=sys.stderr, flush=True)
            child = multiprocessing.get_context("spawn").Process(
                target=export_onnx, args=(c, grid, pixel_values, Path(work), "ort-int8" in names))
            child.start()
            child.join()
            if child.exitcode != 0:
                raise SystemExit(f"vision_bench: the ONNX export failed (exit {child.exitcode})")
        embeds: dict[str, Embed] = {}
        for name in names:
            print(f"vision_bench: building {name}", file=sys.stderr, flush=True)
            embeds[name] = candidate(name, c, threads, grid, pixel_values, Path(work))
        reference = None
        for name, embed in embeds.items():  # warm-up: first-call allocations and kernel selection
            rows = embed(pixel_values, grid)
            if name == "exact":
                reference = rows
            out[name] = {"tokens": rows.shape[0], "finite": bool(torch.isfinite(rows).all()), "_rows": rows}
        seconds: dict[str, list[float]] = {name: [] for name in embeds}
        for r in range(rounds):
            order = list(embeds) if r % 2 == 0 else list(embeds)[::-1]
            for name in order:
                start = time.perf_counter()
                embeds[name](pixel_values, grid)
                seconds[name].append(time.perf_counter() - start)
            last = {n: round(s[-1], 2) for n, s in seconds.items()}
            print(f"vision_bench: round {r + 1}/{rounds} {json.dumps(last)}", file=sys.stderr, flush=True)
    for name, spent in seconds.items():
        entry = out[name]
        rows = entry.pop("_rows")
        entry |= {"median_s": round(statistics.median(spent), 3), "min_s": round(min(spent), 3),
                  "max_s": round(max(spent), 3)}
        if "exact" in seconds:
            ratios = [e / s for e, s in zip(seconds["exact"], spent)]
            entry |= {"speedup_median": round(statistics.median(ratios), 2), "speedup_min": round(min(ratios), 2),
                      "speedup_max": round(max(ratios), 2)}
        if reference is not None:
            entry["rows"] = rows_error(rows, reference)
    return out


# ------------------------------------------------------------------ parity on the tiny releases
def _png(width: int, height: int, seed: int) -> str:
    import PIL.Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * (7 + c) + y * (3 + 2 * c)) % 256 for c in range(3)], axis=-1)
    array = np.clip(base + rng.integers(-40, 40, size=(height, width, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(array, "RGB").save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


QUESTIONS = {"cat": {"type": "noul", "instructions": "Is there a cat?"},
             "color": {"type": "choice", "criteria": {"red": None, "green": "Mostly green", "blue": None}},
             "busy": {"type": "score", "criteria": ["calm", "busy", "chaotic"]}}


def parity_requests() -> list[dict]:
    """tests/media/test_media_parity.py's requests."""
    video = [[_png(32, 24, seed) for seed in range(10, 14)]]
    return [
        {"state": "One small image.", "images": [_png(16, 16, 1)], "questions": QUESTIONS},
        {"state": "A wide one.", "images": [_png(56, 24, 2)], "questions": QUESTIONS},
        {"state": "A tall one that resizes.", "images": [_png(40, 100, 3)], "questions": QUESTIONS},
        {"state": "Two images.", "images": [_png(24, 32, 4), _png(48, 16, 5)], "questions": QUESTIONS},
        {"state": {"ticket": 48213, "text": "Photo attached", "amount": 19.99}, "images": [_png(32, 32, 6)],
         "questions": QUESTIONS},
        {"state": "A clip.", "videos": [video], "media_kwargs": {"do_sample_frames": False}, "questions": QUESTIONS},
        {"state": "A smaller budget.", "images": [_png(64, 64, 7)],
         "media_kwargs": {"size": {"shortest_edge": 256, "longest_edge": 1024}}, "questions": QUESTIONS},
    ]


def strengthen(release: Path, seed: int = 17) -> None:
    """Every vision tensor of ``release`` redrawn at O(1) scale, in place (tests/vision/test_vision_model.py's
    "strong" release): the tiny release's own vision weights (~0.02) barely move its answers."""
    from safetensors.torch import load_file, save_file

    from clef_gguf.convert.synthetic.tiny import strong_vision_tensor

    gen = torch.Generator().manual_seed(seed)

    for path in sorted(release.glob("*.safetensors")):
        tensors = load_file(str(path))
        tensors = {n: strong_vision_tensor(n, t, gen) if n.startswith("model.visual.") else t
                   for n, t in tensors.items()}
        save_file(tensors, str(path), metadata={"format": "pt"})


def parity(releases: list[str], threads: int) -> dict:
    from clef_gguf import Clef
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.synthetic.tiny import build_release
    from clef_gguf.core.limits import VISION_ENGINES

    requests = parity_requests()
    report: dict = {"requests": len(requests), "margin": 0.01}
    with tempfile.TemporaryDirectory(prefix="vision-parity-") as work:
        for spec in releases:
            name, strong = spec.removesuffix("+strong"), spec.endswith("+strong")
            preset, _, seed = name.partition(":")
            print(f"vision_bench: parity on {spec}", file=sys.stderr, flush=True)
            root = Path(work) / spec.replace(":", "-").replace("+", "-")
            release = build_release(root / "release", preset=preset, seed=int(seed or 0))
            if strong:
                strengthen(release)
            model = convert_release(release, root / "model", outtype="f32", name=f"clef-{preset}")
            probs: dict[str, list[list[np.ndarray]]] = {}
            for engine in VISION_ENGINES:
                with Clef.load(model, threads=threads, state_cache_mb=0, vision_cache_mb=0,
                               vision_engine=engine) as clef:
                    probs[engine] = [clef.probabilities(r) for r in requests]
                    if engine == "exact":
                        other = dict(requests[4], images=[_png(32, 32, 99)])
                        moved = max(float(np.abs(a - b).max())
                                    for a, b in zip(clef.probabilities(other), probs[engine][4]))
            entry: dict = {"moved_by_another_picture": float(f"{moved:.3g}")}
            for engine in VISION_ENGINES:
                if engine == "exact":
                    continue
                worst, agree, checked = 0.0, 0, 0
                for ours, ref in zip(probs[engine], probs["exact"]):
                    for got, want in zip(ours, ref):
                        worst = max(worst, float(np.abs(got - want).max()))
                        top = np.sort(want)[::-1]
                        if top[0] - top[1] > report["margin"]:
                            checked += 1
                            agree += int(np.argmax(got) == np.argmax(want))
                entry[engine] = {"max_abs_dp": float(f"{worst:.3g}"), "argmax_agree": f"{agree}/{checked}"}
            report[spec] = entry
    return report


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
    parser.add_argument("--rounds", "--runs", type=int, default=5, help="timed rounds (one call per engine each)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", default="exact,int8",
                        help="candidates, comma-separated (exact first: the others are compared with it)")
    parser.add_argument("--parity", action="store_true", help="also decide pictures on the tiny releases per engine")
    parser.add_argument("--releases", default="tiny:0,tiny:1,tiny:2,tiny256:0,tiny:0+strong,tiny:1+strong,"
                        "tiny256:0+strong", help="the tiny releases --parity builds, preset:seed, +strong: "
                        "their vision tensors redrawn at O(1) scale")
    parser.add_argument("--no-timing", action="store_true", help="only --parity")
    args = parser.parse_args(argv)
    if args.size % (FLASH_9B.patch_size * FLASH_9B.spatial_merge_size):
        parser.error("--size must be a multiple of 32 (one merged token covers 32 x 32 pixels)")
    report: dict = {"cpu": platform.processor() or platform.machine(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(), "vnni": engines.has_vnni(),
                    "quantized_engine": torch.backends.quantized.engine, "torch": torch.__version__,
                    "threads": args.threads}
    if not args.no_timing:
        report |= {"shape": "Clef-Flash 9B vision tower (random weights)", "config": FLASH_9B.__dict__,
                   "image": f"{args.size}x{args.size}", "rounds": args.rounds,
                   "matmul_gflops_fp32": matmul_gflops(args.threads)}
        report["engines"] = timing(args.engines.split(","), args.size, args.rounds, args.threads)
    if args.parity:
        report["parity"] = parity(args.releases.split(","), args.threads)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
