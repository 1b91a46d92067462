"""llama.cpp's mtmd vision encoder against clef-gguf's PyTorch vision tower, on a random tiny release.
Prints one JSON report: per picture, the token grid each engine gives, max |Δ| of the embeddings where
the grids agree, and CPU seconds per picture (preprocessing and encoder apart). One experiment kept in
one file (it runs outside the project's venv), hence past the house's ~400 lines; docs/media.md has
its results.

The environment (this project's CI builds llama-cpp-python without libmtmd; this script needs it):

    python3 -m venv --system-site-packages /work/venv-mtmd
    # see torch, transformers and the editable clef_gguf of the project's venv from the new one:
    echo "import site; site.addsitedir('/work/venv/lib/python3.11/site-packages')" \\
        > /work/venv-mtmd/lib/python3.11/site-packages/zz_workvenv.pth
    source /work/venv-mtmd/bin/activate
    CMAKE_ARGS="-DLLAVA_BUILD=ON" nice -n 10 pip install --no-deps --no-cache-dir --force-reinstall \\
        llama-cpp-python==0.3.36
    python -c "import llama_cpp.mtmd_cpp"   # libmtmd loads

Run it (LLAMA_CPP_SRC: the llama.cpp tree vendored in the llama-cpp-python 0.3.36 sdist, for its
``convert_hf_to_gguf.py --mmproj`` and its ``gguf-py``):

    python scripts/mtmd_compare.py --llama-cpp-src .../llama-cpp-python-0.3.36/vendor/llama.cpp \\
        [--work DIR] [--preset tiny] [--threads 1] [--runs 5] [--mmproj-types f32,f16] \\
        [--flash-size 448 --flash-runs 1]

What it does: builds the release (``clef_gguf.convert.synthetic.tiny.build_release``), converts its language
tower with clef-gguf's converter (mtmd needs a text model for the embedding width and the
``<|vision_start|>``/``<|vision_end|>`` ids) and its vision tower with llama.cpp's own converter, then
embeds each picture three ways:

- ``ours``: the reference's preprocessing (``clef_gguf.media.prepare_media``) and ``VisionTower.embed``;
- ``mtmd``: the original RGB bytes through ``mtmd_tokenize`` (mtmd's own resize and token limits) and
  ``mtmd_encode_chunk``, with mtmd's default limits (8-4096 tokens for Qwen-VL), with
  ``image_min_tokens``/``image_max_tokens`` set to the release processor's pixel bounds, and with those
  bounds and flash attention off (left on auto, mtmd's first encode turns it on: K and V in f16);
- ``on_ref_pixels``: the picture already resized by the reference's resize (uint8, at the reference's
  size) given to mtmd, so only the encoders' arithmetic differs; ``tanh_merger`` compares with ours
  with the merger's exact GELU swapped for the tanh one mtmd's graph uses, to tell that part of the
  difference from the rest.

Two weight sets: the release's own (N(0, 0.02): near-zero attention logits, so a structural error would
hardly show) and the same release with the vision tensors redrawn at O(1) scale (``strong_weights``,
tests/vision/test_vision_model.py's rule), where it would show as an O(1) difference. ``--flash-size``
also times one picture on a random tower of Clef-Flash's vision shape (27 blocks, width 1152).

CPU seconds are ``time.process_time`` (all threads of this process), the median of RUNS after one
warm-up, with the same thread count for both engines. Random weights: numbers about agreement and
cost only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

from clef_gguf.convert.synthetic.big import FLASH_PROCESSORS, FLASH_VISION

# (width, height, seed): no resize, a resize up to the minimum, a round-half case past the maximum
# (100 / 8 = 12.5), the maximum, a resize down past the maximum, an odd size, a long thin one, and two
# round-half cases inside the bounds (84 / 8 = 10.5, 36 / 8 = 4.5: the reference rounds half to even).
PICTURES = ((16, 16, 0), (56, 24, 1), (40, 100, 2), (64, 64, 3), (100, 100, 4), (33, 47, 5), (200, 8, 6),
            (40, 84, 7), (60, 36, 8))


def picture(width: int, height: int, seed: int) -> PIL.Image.Image:
    """Smooth gradients plus noise (the tests' ``media_helpers.picture``): resizing shows in every pixel."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * (7 + c) + y * (3 + 2 * c)) % 256 for c in range(3)], axis=-1)
    noise = rng.integers(-40, 40, size=(height, width, 3))
    return PIL.Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def cpu_seconds(fn: Callable[[], Any], runs: int) -> tuple[Any, float]:
    """fn's result and the median CPU seconds of ``runs`` calls after a warm-up."""
    out = fn()
    times = []
    for _ in range(runs):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return out, statistics.median(times)


# --------------------------------------------------------------------------- building the files

def build_files(work: Path, preset: str, llama_src: Path,
                mmproj_types: list[str]) -> tuple[Path, Path, dict[str, Path]]:
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.synthetic.tiny import build_release

    release = work / "release"
    if not (release / "config.json").is_file():
        build_release(release, preset=preset, seed=0)
    model_dir = work / "model"
    if not (model_dir / "tower-f32.gguf").is_file():
        convert_release(release, model_dir, outtype="f32", name=f"clef-{preset}-random")
    return release, model_dir / "tower-f32.gguf", convert_mmprojs(release, work, "", llama_src, mmproj_types)


def convert_mmprojs(release: Path, work: Path, prefix: str, llama_src: Path,
                    mmproj_types: list[str]) -> dict[str, Path]:
    """llama.cpp's own ``convert_hf_to_gguf.py --mmproj`` on ``release``, one file per out type."""
    mmprojs = {}
    for outtype in mmproj_types:
        path = work / f"{prefix}mmproj-{outtype}.gguf"
        if not path.is_file():
            env = {**os.environ, "PYTHONPATH": str(llama_src / "gguf-py")}
            command = [sys.executable, str(llama_src / "convert_hf_to_gguf.py"), str(release), "--mmproj",
                       "--outtype", outtype, "--outfile", str(path)]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"convert_hf_to_gguf.py --mmproj --outtype {outtype} failed:\n{done.stderr[-4000:]}")
        mmprojs[outtype] = path
    return mmprojs


# Clef-Flash 9B's vision_config (convert.synthetic.big.FLASH_VISION), except the output width: mtmd checks it against
# the text model's, and the text model here is the tiny one. The merger's last matmul is then 64 wide instead
# of 4096 (under 1% of the tower's arithmetic at 448x448), so the time is the 9B tower's, less that.
# Qwen3-VL's processor bounds (pixels); a 448x448 picture keeps its size (196 tokens).
FLASH_PROCESSOR_SIZE = FLASH_PROCESSORS["preprocessor_config.json"]["size"]


def build_flash_shape(work: Path, release: Path, llama_src: Path,
                      mmproj_types: list[str]) -> tuple[Path, dict[str, Path]]:
    """The tiny release with its vision tower replaced by a random one of Clef-Flash's vision shape (bf16,
    N(0, 0.02) matrices, unit norms, zero biases) and Qwen3-VL's patch-16 processor; its mmprojs."""
    from safetensors.torch import load_file, save_file

    out = work / "flash-shape-release"
    if not (out / "model.safetensors").is_file():
        out.mkdir(parents=True, exist_ok=True)
        for f in release.iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "config.json", "preprocessor_config.json"):
                (out / f.name).write_bytes(f.read_bytes())
        config = json.loads((release / "config.json").read_text())
        v = {**config["vision_config"], **FLASH_VISION}
        config["vision_config"] = v
        (out / "config.json").write_text(json.dumps(config, indent=2))
        processor = json.loads((release / "preprocessor_config.json").read_text())
        processor.update(patch_size=16, size=FLASH_PROCESSOR_SIZE)
        (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
        tensors = {k: t for k, t in load_file(str(release / "model.safetensors")).items()
                   if not k.startswith("model.visual.")}
        gen = torch.Generator().manual_seed(0)
        D, inner, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
        p, pre = v["patch_size"], "model.visual."
        shapes = {"patch_embed.proj.weight": [D, 3, v["temporal_patch_size"], p, p], "patch_embed.proj.bias": [D],
                  "pos_embed.weight": [v["num_position_embeddings"], D], "merger.norm.weight": [D],
                  "merger.norm.bias": [D], "merger.linear_fc1.weight": [merged, merged],
                  "merger.linear_fc1.bias": [merged], "merger.linear_fc2.weight": [v["out_hidden_size"], merged],
                  "merger.linear_fc2.bias": [v["out_hidden_size"]]}
        for j in range(v["depth"]):
            b = f"blocks.{j}."
            shapes |= {b + "norm1.weight": [D], b + "norm1.bias": [D], b + "norm2.weight": [D], b + "norm2.bias": [D],
                       b + "attn.qkv.weight": [3 * D, D], b + "attn.qkv.bias": [3 * D], b + "attn.proj.weight": [D, D],
                       b + "attn.proj.bias": [D], b + "mlp.linear_fc1.weight": [inner, D],
                       b + "mlp.linear_fc1.bias": [inner], b + "mlp.linear_fc2.weight": [D, inner],
                       b + "mlp.linear_fc2.bias": [D]}
        for name, shape in shapes.items():
            if "norm" in name and name.endswith("weight"):
                t = torch.ones(shape)
            elif name.endswith("bias"):
                t = torch.zeros(shape)
            else:
                t = torch.randn(shape, generator=gen) * 0.02
            tensors[pre + name] = t.to(torch.bfloat16)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, convert_mmprojs(out, work, "flash-shape-", llama_src, mmproj_types)


# --------------------------------------------------------------------------- mtmd

class Mtmd:
    """One mtmd context over a text model; ``embed(rgb uint8 [H, W, 3])`` -> (grid (ny, nx), [n, d])."""

    def __init__(self, mmproj: Path, model: Any, threads: int, min_tokens: int = 0, max_tokens: int = 0,
                 flash_attn: int = -1) -> None:
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.m, self.n_embd = mtmd_cpp, llama_cpp.llama_model_n_embd(model)
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu, params.print_timings, params.warmup = False, False, False
        params.n_threads, params.image_min_tokens, params.image_max_tokens = threads, min_tokens, max_tokens
        # -1 auto: the first encode turns flash attention on (K and V cast to f16); 0 off
        params.flash_attn_type = flash_attn
        self.ctx = mtmd_cpp.mtmd_init_from_file(str(mmproj).encode(), model, params)
        if not self.ctx:
            raise SystemExit(f"mtmd_init_from_file failed for {mmproj}")

    def tokenize(self, rgb: np.ndarray) -> Any:
        m = self.m
        rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
        h, w, _ = rgb.shape
        bitmap = m.mtmd_bitmap_init(w, h, rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        text = m.mtmd_input_text(m.mtmd_default_marker(), len(m.mtmd_default_marker()), False, True)
        chunks = m.mtmd_input_chunks_init()
        bitmaps = (m.mtmd_bitmap_p_ctypes * 1)(bitmap)
        rc = m.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1)
        m.mtmd_bitmap_free(bitmap)
        if rc != 0:
            m.mtmd_input_chunks_free(chunks)
            raise RuntimeError(f"mtmd_tokenize returned {rc}")
        return chunks

    def image_chunk(self, chunks: Any) -> Any:
        m = self.m
        for i in range(m.mtmd_input_chunks_size(chunks)):
            chunk = m.mtmd_input_chunks_get(chunks, i)
            if m.mtmd_input_chunk_get_type(chunk) == m.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                return chunk
        raise RuntimeError("mtmd_tokenize gave no image chunk")

    def encode(self, chunk: Any) -> np.ndarray:
        m = self.m
        n = m.mtmd_input_chunk_get_n_tokens(chunk)
        if m.mtmd_encode_chunk(self.ctx, chunk) != 0:
            raise RuntimeError("mtmd_encode_chunk failed")
        out = m.mtmd_get_output_embd(self.ctx)
        return np.ctypeslib.as_array(out, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy()

    def grid(self, chunk: Any) -> tuple[int, int]:
        tokens = self.m.mtmd_input_chunk_get_tokens_image(chunk)
        return int(self.m.mtmd_image_tokens_get_ny(tokens)), int(self.m.mtmd_image_tokens_get_nx(tokens))

    def measure(self, rgb: np.ndarray, runs: int) -> dict[str, Any]:
        chunks = self.tokenize(rgb)
        chunk = self.image_chunk(chunks)
        grid = self.grid(chunk)
        embd, encode_s = cpu_seconds(lambda: self.encode(chunk), runs)
        self.m.mtmd_input_chunks_free(chunks)
        _, prep_s = cpu_seconds(lambda: self.m.mtmd_input_chunks_free(self.tokenize(rgb)), runs)
        return {"grid": grid, "tokens": grid[0] * grid[1], "embd": embd, "prep_s": prep_s, "encode_s": encode_s}

    def close(self) -> None:
        self.m.mtmd_free(self.ctx)


# --------------------------------------------------------------------------- ours

def ours(tower: Any, config: Any, image: PIL.Image.Image, runs: int) -> dict[str, Any]:
    from clef_gguf.media.config import parse_media_kwargs
    from clef_gguf.media.placeholders import prepare_media

    options, _ = parse_media_kwargs(None)
    prepared, prep_s = cpu_seconds(lambda: prepare_media([image], [], config, options), runs)
    batch = prepared.images
    embd, encode_s = cpu_seconds(lambda: tower.embed(batch.pixel_values, batch.grid_thw), runs)
    _, h, w = batch.grid_thw[0].tolist()
    m = config.image.merge_size
    return {"grid": (h // m, w // m), "tokens": prepared.image_tokens[0], "embd": embd.numpy(),
            "prep_s": prep_s, "encode_s": encode_s, "batch": batch}


def reference_pixels(image: PIL.Image.Image, config: Any) -> np.ndarray:
    """The picture resized as the reference's processor resizes it, uint8 [H, W, 3]."""
    from clef_gguf.media import processor

    s = config.image
    pixels = processor.to_tensor(image)
    h, w = processor.smart_resize(pixels.shape[1], pixels.shape[2], s.factor, s.shortest_edge, s.longest_edge)
    if (h, w) != tuple(pixels.shape[1:]):
        pixels = processor.resize(pixels, h, w, s.resample)
    return pixels.permute(1, 2, 0).contiguous().numpy()


def tanh_merger(tower: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The merger with the tanh GELU in place of the exact one (what mtmd's qwen3vl graph computes)."""
    merger = tower.model.merger

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = merger.norm(x).reshape(-1, merger.merged_dim)
        return merger.linear_fc2(F.gelu(merger.linear_fc1(x), approximate="tanh"))

    return forward


def max_delta(a: np.ndarray, b: np.ndarray) -> float | None:
    return float(np.abs(a - b).max()) if a.shape == b.shape else None


def flash_shape(work: Path, release: Path, args: argparse.Namespace, types: list[str], model: Any) -> dict[str, Any]:
    """One picture through both engines at Clef-Flash's vision shape: tokens, max |Δ|, CPU seconds."""
    from clef_gguf.media.config import load_processor_config
    from clef_gguf.vision import VisionTower

    flash_release, mmprojs = build_flash_shape(work, release, args.llama_cpp_src, types)
    config = load_processor_config(flash_release)
    tower = VisionTower.load(flash_release, threads=args.threads)
    image = picture(args.flash_size, args.flash_size, 7)
    ref = ours(tower, config, image, args.flash_runs)
    out: dict[str, Any] = {"picture": f"{args.flash_size}x{args.flash_size}", "ours": {
        "grid": list(ref["grid"]), "tokens": ref["tokens"], "prep_cpu_s": ref["prep_s"],
        "encode_cpu_s": ref["encode_s"], "max_abs": float(np.abs(ref["embd"]).max())}}
    del tower
    for outtype, path in mmprojs.items():
        engine = Mtmd(path, model, args.threads)
        got = engine.measure(np.asarray(image), args.flash_runs)
        engine.close()
        out[f"mtmd_{outtype}"] = {"grid": list(got["grid"]), "tokens": got["tokens"], "prep_cpu_s": got["prep_s"],
                                  "encode_cpu_s": got["encode_s"],
                                  "max_delta_vs_ours": max_delta(got["embd"], ref["embd"])}
        print(json.dumps({"flash_shape": out}), file=sys.stderr, flush=True)
    return out


def strong_release(work: Path, release: Path) -> Path:
    """The release with every vision tensor redrawn at O(1) scale (tests/vision/test_vision_model.py's
    rule): at the release's N(0, 0.02) the attention logits are near zero, so a wrong RoPE or position
    grid would hardly move the embeddings; here it moves them by O(1)."""
    from safetensors.torch import load_file, save_file

    from clef_gguf.convert.synthetic.tiny import strong_vision_tensor

    out = work / "strong-release"
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(17)
    for path in sorted(release.iterdir()):
        if path.suffix != ".safetensors":
            (out / path.name).write_bytes(path.read_bytes())
            continue
        tensors = load_file(str(path))
        for name, t in tensors.items():
            if not name.startswith("model.visual."):
                continue
            tensors[name] = strong_vision_tensor(name, t, gen)  # the tests' "strong" release
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
    return out


def compare(release: Path, mmprojs: dict[str, Path], model: Any,
            args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[int]]:
    """Every picture through ours and through mtmd (each mmproj type, default and processor token limits)."""
    from clef_gguf.media.config import load_processor_config
    from clef_gguf.vision import VisionTower

    config = load_processor_config(release)
    tower = VisionTower.load(release, threads=args.threads)
    tanh_forward = tanh_merger(tower)
    factor2 = config.image.factor ** 2
    bounds = (config.image.shortest_edge // factor2, config.image.longest_edge // factor2)
    limits = {"mtmd_default_limits": (0, 0, -1), "mtmd_processor_limits": (*bounds, -1),
              "mtmd_processor_limits_no_flash_attn": (*bounds, 0)}
    rows: list[dict[str, Any]] = []
    engines = {(t, name): Mtmd(path, model, args.threads, *lim) for t, path in mmprojs.items()
               for name, lim in limits.items()}
    for width, height, seed in PICTURES:
        image = picture(width, height, seed)
        ref = ours(tower, config, image, args.runs)
        with torch.inference_mode():
            saved = tower.model.merger.forward
            tower.model.merger.forward = tanh_forward
            try:
                ref_tanh = tower.embed(ref["batch"].pixel_values, ref["batch"].grid_thw).numpy()
            finally:
                tower.model.merger.forward = saved
        row: dict[str, Any] = {"picture": f"{width}x{height}", "ours": {
            "grid": list(ref["grid"]), "tokens": ref["tokens"], "prep_cpu_s": ref["prep_s"],
            "encode_cpu_s": ref["encode_s"], "max_abs": float(np.abs(ref["embd"]).max()),
            "tanh_merger_max_delta": max_delta(ref_tanh, ref["embd"])}}
        resized = reference_pixels(image, config)
        for (outtype, name), engine in engines.items():
            got = engine.measure(np.asarray(image), args.runs)
            on_ref = engine.measure(resized, args.runs)
            row[f"{name}_{outtype}"] = {
                "grid": list(got["grid"]), "tokens": got["tokens"], "prep_cpu_s": got["prep_s"],
                "encode_cpu_s": got["encode_s"], "max_delta_vs_ours": max_delta(got["embd"], ref["embd"]),
                "on_ref_pixels": {"grid": list(on_ref["grid"]),
                                  "max_delta_vs_ours": max_delta(on_ref["embd"], ref["embd"]),
                                  "max_delta_vs_ours_tanh_merger": max_delta(on_ref["embd"], ref_tanh)}}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    for engine in engines.values():
        engine.close()
    return rows, list(bounds)


# --------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-src", type=Path, default=os.environ.get("LLAMA_CPP_SRC"), required=False)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mmproj-types", default="f32,f16")
    parser.add_argument("--flash-size", type=int, default=0,
                        help="also time one SIZE x SIZE picture on a random tower of Clef-Flash's vision shape "
                             "(0: skip; 448 gives 196 tokens)")
    parser.add_argument("--flash-runs", type=int, default=1)
    args = parser.parse_args()
    if args.llama_cpp_src is None:
        parser.error("--llama-cpp-src (or LLAMA_CPP_SRC) is required")
    import llama_cpp

    work = args.work or Path(tempfile.mkdtemp(prefix="mtmd-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    types = [t for t in args.mmproj_types.split(",") if t]
    release, tower_gguf, mmprojs = build_files(work, args.preset, args.llama_cpp_src, types)
    strong = strong_release(work, release)
    weights = {"release_weights": (release, mmprojs),
               "strong_weights": (strong, convert_mmprojs(strong, work, "strong-", args.llama_cpp_src, types))}

    torch.set_num_threads(args.threads)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(tower_gguf).encode(), mparams)
    if not model:
        raise SystemExit(f"llama_model_load_from_file failed for {tower_gguf}")
    report: dict[str, Any] = {"preset": args.preset, "threads": args.threads, "runs": args.runs, "work": str(work)}
    for label, (source, projs) in weights.items():
        report[label], report["processor_token_bounds"] = compare(source, projs, model, args)
    if args.flash_size:
        report["flash_shape"] = flash_shape(work, release, args, types, model)
    llama_cpp.llama_model_free(model)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
