"""A random Clef model at full size, written straight to GGUF (not in CI).

    python -m clef_gguf.convert.synthetic.big OUT [--preset flash9b] [--outtype Q4_K_M] [--layers N]

``flash9b`` has Clef-Flash's 9B shape as the model catalog gives it (``clef-flash``'s architecture in
``models/catalog.json``: hidden 4096, 32 layers 3:1 linear/full, a 248,320-row vocab...) and the
full-size joint head. RANDOM WEIGHTS: for timing and memory measurements only; the answers mean nothing.

``build_random_model`` writes the tower directly in its type (``convert.synthetic.tiled``: random rows
of that type tiled; the 9B Q4_K_M tower in seconds, at disk speed) beside the head files and
``tokenizer.json``, written as ``convert.synthetic.tiny`` writes them. ``write_random_tower`` streams
every value drawn (f32/f16/bf16/q8_0), one tensor in memory at a time (tensors over ``CHUNK_ELEMENTS``
in row blocks), for the tests that compare it with ``build_release`` + ``convert_release``.

For a tiny preset the tower tensors are the ones ``build_release`` + ``convert_release`` give
(tested): the same generator, drawn in the same order (vision and MTP tensors are drawn and
dropped so that the sequence stays in step). ``--layers`` keeps every shape and writes fewer
blocks: a quick run to time before the full one.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from typing import Any
from pathlib import Path

import gguf
import numpy as np
import torch

from clef_gguf.formats import files
from clef_gguf.convert import gguf_vocab
from clef_gguf.convert.synthetic import tiled, tiny
from clef_gguf.convert.synthetic.shapes import PlannedTensor, plan, preset_config, presets
from clef_gguf.convert import tensor_map as tm
from clef_gguf.convert.hf_to_gguf import add_metadata, stream_gguf
from clef_gguf.core.errors import ConversionError
from clef_gguf.core.limits import GB, GiB

# Clef-Flash's vision tower (Qwen3.5-9B's vision_config: 27 blocks, width 1152, 456M parameters) and
# Qwen3-VL's published processor settings (16-pixel patches merged 2x2: one token per 32x32 pixels; a
# 448x448 picture keeps its size, 196 tokens). ``--vision`` writes a random one beside the tower.
FLASH_VISION: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304, "in_channels": 3}
_FLASH_PROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                    "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor"}
FLASH_PROCESSORS = {
    "preprocessor_config.json": {**_FLASH_PROCESSOR, "size": {"shortest_edge": 65536, "longest_edge": 16777216},
                                 "image_processor_type": "Qwen2VLImageProcessorFast"},
    "video_preprocessor_config.json": {**_FLASH_PROCESSOR, "size": {"shortest_edge": 4096,
                                                                    "longest_edge": 25165824},
                                       "video_processor_type": "Qwen3VLVideoProcessor"},
}
# Tensors with more values than this are drawn in row blocks of at most this many values.
CHUNK_ELEMENTS = 1 << 26
# Bytes per value of the tower written, for the free-disk check. Every llama.cpp quant counts as
# Q8_0, the largest (Q4_K_M is ~0.63): the check may ask for a few GB too many, never too few.
_BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 1.07}
_QUANT_BYTES_PER_VALUE = 1.07
RANDOM_WARNING = "RANDOM WEIGHTS - for timing only; the answers mean nothing."


def _encode(values: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    # bf16 through torch (one pass); the values are bf16 already, so the bits are gguf-py's too.
    if qtype == gguf.GGMLQuantizationType.BF16:
        return values.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
    return tm.encode(values.to(torch.float32).numpy(), qtype)


class _RowBlocks:
    """A tensor GGUFWriter writes without holding it: ``write_tensor_data`` only reads ``nbytes``
    and calls ``tofile``, so the rows are drawn there, block by block, in file order. Drawing at
    write time keeps the shared generator in the same order as the file."""

    def __init__(self, item: PlannedTensor, gen: torch.Generator):
        kind, self.scale = item.rule
        if kind != "normal" or item.edits or len(item.shape) != 2:
            raise ConversionError(f"{item.hf_name} is too large to draw at once and is not a plain "
                                  "matrix: raise CHUNK_ELEMENTS or split its edits")
        self.item, self.gen = item, gen
        self.nbytes = item.layout[2]
        self.rows = max(1, CHUNK_ELEMENTS // item.shape[1])

    def tofile(self, fh) -> None:
        n_rows, n_cols = self.item.shape
        for start in range(0, n_rows, self.rows):
            block = torch.randn((min(self.rows, n_rows - start), n_cols), generator=self.gen) * self.scale
            _encode(block.to(torch.bfloat16), self.item.stored[1]).tofile(fh)


def _payloads(items: list[PlannedTensor], d: tm.Dims, gen: torch.Generator):
    for item in items:
        if math.prod(item.shape) > CHUNK_ELEMENTS and item.gguf_name is not None:
            yield _RowBlocks(item, gen)
            continue
        # As build_release stores it (bf16), then as hf_to_gguf reads and edits it (f32).
        values = tiny.init_tensor(item.shape, item.rule, gen).to(torch.bfloat16)
        if item.gguf_name is None:
            continue  # drawn only to keep the generator in step with build_release
        yield _encode(tm.apply_edits(values.to(torch.float32), item.edits, d), item.stored[1])


def write_random_tower(path, *, preset: str = "flash9b", outtype: str = "bf16", seed: int = 0,
                       layers: int | None = None, tokenizer_json=None, name: str | None = None) -> dict:
    """Stream a random qwen35 tower GGUF of ``preset`` into ``path``; returns a summary.

    ``outtype`` is one of the converter's direct types (f32/f16/bf16/q8_0); ``tokenizer_json`` the
    file whose vocabulary goes into the GGUF (default: the demo tokenizer, trained here).
    """
    if outtype not in tm.OUTTYPES:
        raise ConversionError(f"the streaming writer writes {', '.join(tm.OUTTYPES)}; quantize after")
    p = preset_config(preset, layers)
    tok = tiny.build_tokenizer(p["bpe_vocab"])
    text, d, items = plan(p, outtype, tok)
    if tokenizer_json is None:
        tokenizer_json = Path(path).with_name(Path(path).name + ".tokenizer.json")
        tok.save(str(tokenizer_json))
        cleanup = tokenizer_json
    else:
        cleanup = None
    try:
        vocab = gguf_vocab.read_vocab(Path(tokenizer_json), d.vocab, tiny.tokenizer_config(tok), text)
    finally:
        if cleanup is not None:
            cleanup.unlink(missing_ok=True)
    writer = gguf.GGUFWriter(path=None, arch="qwen35")
    add_metadata(writer, text, d, outtype, name or f"clef-random-{preset}-seed{seed}")
    gguf_vocab.add_to_writer(writer, vocab)
    written = [item for item in items if item.gguf_name is not None]
    for item in written:
        shape, dtype, nbytes = item.layout
        gguf_name, qtype = item.stored
        writer.add_tensor_info(gguf_name, shape, dtype, nbytes, raw_dtype=qtype)
    start = time.perf_counter()
    stream_gguf(writer, Path(path), _payloads(items, d, torch.Generator().manual_seed(seed)))
    return {"tensors": len(written), "values": sum(math.prod(i.shape) for i in written),
            "bytes": Path(path).stat().st_size, "seconds": round(time.perf_counter() - start, 1)}


def write_random_vision(out: Path, p: dict, seed: int = 0) -> dict[str, str]:
    """A random vision tower of Clef-Flash's shape in ``out`` (``vision_config.json``, bf16
    ``vision.safetensors`` as the release stores it, the processor files); the manifest's entry."""
    from safetensors.torch import save_file

    from clef_gguf.vision import load as vision_load

    gen = torch.Generator().manual_seed(seed + 1)  # not the tower's stream: the tower stays as it was
    tensors = {name.removeprefix("model.visual."): tiny.init_tensor(shape, rule, gen).to(torch.bfloat16)
               for name, shape, rule in tiny.vision_tensors(p, FLASH_VISION)}
    save_file(tensors, str(out / vision_load.VISION_WEIGHTS), metadata={"format": "pt"})
    config = {"model_type": "qwen3_5_vision", "hidden_act": "gelu_pytorch_tanh", "out_hidden_size": p["hidden"],
              "initializer_range": 0.02, **FLASH_VISION}
    (out / vision_load.VISION_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name, settings in FLASH_PROCESSORS.items():
        (out / name).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    return {"weights": vision_load.VISION_WEIGHTS, "config": vision_load.VISION_CONFIG}


def _free_bytes(out: Path) -> int:
    base = out.absolute()
    while not base.is_dir():
        base = base.parent
    return shutil.disk_usage(base).free


def needed_bytes(p: dict, outtype: str) -> int:
    """The tower's size on disk, estimated from the tensor list (never under the real size)."""
    values = sum(math.prod(shape) for name, shape, _ in tiny.tensor_specs(p)
                 if not name.startswith(tm.SKIP_PREFIXES))
    return int(values * _BYTES_PER_VALUE.get(outtype, _QUANT_BYTES_PER_VALUE))


def build_random_model(out, *, preset: str = "flash9b", outtype: str = "Q4_K_M", seed: int = 0,
                       layers: int | None = None, vision: bool = False, full_vocab: bool = False) -> dict:
    """A clef-gguf model directory ``out`` (tower written directly in ``outtype`` by
    ``convert.synthetic.tiled``, head files, tokenizer, manifest; ``vision``: a random vision tower of
    Clef-Flash's shape too; ``full_vocab``: a tokenizer as large as the release's, in tokenizer.json and
    the GGUF, so that its memory is measured too); returns a summary."""
    outtype = tiled.canonical(outtype)
    p = preset_config(preset, layers)
    out = Path(out)
    tower_bytes = needed_bytes(p, outtype)
    head_bytes = GiB  # the full-size head in bf16 is ~0.3 GB; a margin for the manifest's temp
    free = _free_bytes(out)
    if free < tower_bytes + head_bytes:
        raise ConversionError(f"{out}: needs ~{(tower_bytes + head_bytes) / GB:.1f} GB free "
                              f"(tower {tower_bytes / GB:.1f} GB + head), has {free / GB:.1f} GB")
    name = f"clef-random-{preset}{'' if layers is None else f'-{layers}l'}-{outtype}-seed{seed}"
    timings = {}
    start = time.perf_counter()
    with files.staged_directory(out) as stage:
        tok = tiny.build_tokenizer(p["bpe_vocab"])
        if full_vocab:
            tok = tiny.full_size_tokenizer(tok, p["vocab_size"], seed)
        tok.save(str(stage / files.TOKENIZER))
        t0 = time.perf_counter()
        tiny.write_head(stage, p["head"], seed)
        timings["head_s"] = round(time.perf_counter() - t0, 1)
        vision_files: tuple[str, ...] = ()
        if vision:
            t0 = time.perf_counter()
            vision_files = tuple(write_random_vision(stage, p, seed).values())
            timings["vision_s"] = round(time.perf_counter() - t0, 1)
        tower = f"tower-{outtype}.gguf"
        written = tiled.write_tiled_tower(stage / tower, preset=preset, outtype=outtype, seed=seed, layers=layers,
                                          tokenizer_json=stage / files.TOKENIZER, name=name)
        timings["write_s"] = written["seconds"]
        source = {"random_weights": True, "preset": preset, "layers": p["layers"], "seed": seed,
                  "generator": "clef_gguf.convert.synthetic.tiled"}
        files.write_manifest(stage, name, outtype,
                             {"tower": tower, "head_weights": files.HEAD_WEIGHTS,
                              "head_config": files.HEAD_CONFIG, "tokenizer": files.TOKENIZER},
                             extra={"source": source}, also=vision_files)  # the vision cache's keys
        tower_bytes = (stage / tower).stat().st_size
    timings["total_s"] = round(time.perf_counter() - start, 1)
    return {"model_dir": str(out), "tower": str(out / tower), "outtype": outtype, "preset": preset,
            "layers": p["layers"], "tensors": written["tensors"], "tensor_types": written["tensor_types"],
            "tower_bytes": tower_bytes, **timings, "warning": RANDOM_WARNING}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clef_gguf.convert.synthetic.big", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output model directory (created if missing)")
    ap.add_argument("--preset", choices=list(presets()), default="flash9b",
                    help="shape (default flash9b: Clef-Flash's 9B tower and full-size head)")
    ap.add_argument("--outtype", default="Q4_K_M", metavar="TYPE",
                    help="f32/f16/bf16/q8_0, a llama.cpp quant whose mix is K-quants, Q4_0-Q8_0 or IQ4 "
                         "(its per-tensor types), or nvfp4 (an NVFP4 checkpoint's GGUF); default Q4_K_M")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--layers", type=int, help="write only this many blocks (a multiple of 4), "
                    "same shapes: time a short run before the full one")
    ap.add_argument("--vision", action="store_true", help="also a random vision tower of Clef-Flash's shape "
                    "(27 blocks, width 1152; 0.9 GB bf16) and its processor files, for `bench --picture`")
    ap.add_argument("--full-vocab", action="store_true", help="a tokenizer as large as the release's (248,320 "
                    "tokens and as many merges, in tokenizer.json and the GGUF) instead of the demo's 512: what "
                    "the real tokenizer costs in memory and load time")
    args = ap.parse_args(argv)
    print(f"clef_gguf.convert.synthetic.big: {RANDOM_WARNING}", file=sys.stderr)
    summary = build_random_model(args.out, preset=args.preset, outtype=args.outtype, seed=args.seed,
                                 layers=args.layers, vision=args.vision, full_vocab=args.full_vocab)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
