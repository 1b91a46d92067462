"""A compressed-tensors NVFP4 checkpoint -> a ``qwen35`` tower GGUF whose quantized projections are
ggml ``NVFP4`` tensors: the same codes and scales, re-encoded, not re-quantized.

compressed-tensors (``nvfp4-pack-quantized``) stores a quantized Linear as ``weight_packed`` (uint8
[N, K/2], element 2j in the low nibble, 2j+1 in the high one), ``weight_scale`` (float8 e4m3 [N, K/16],
one per 16 values) and ``weight_global_scale`` (fp32 [1]), and decodes W = E2M1(code) * scale /
global_scale. ggml's ``block_nvfp4`` (the vendored ``ggml-common.h``) holds 64 values in 36 bytes: the 4
scale bytes of its 16-value groups (UE4M3: e4m3 with the sign bit clear), then 4 x 8 code bytes, byte
j of group s holding element 16s + j in the low nibble and 16s + j + 8 in the high one; llama.cpp
multiplies a matmul's output by the tensor's second scale ``<name>.scale`` (F32 [1]): so that is
1 / global_scale. The codes' 4-bit values mean the same in both (ggml's table is twice compressed-
tensors', and its UE4M3 decode halves the scale). Nothing is rounded: :func:`ggml_blocks` moves bits.

The tower's edits for llama.cpp (``tensor_map``: V heads from grouped to tiled order) are row or
column permutations: applied to the codes and, group by group, to the scales before the re-layout.
Everything the checkpoint kept unquantized (embeddings, lm_head, norms, the GDN gates and conv) goes
through ``hf_to_gguf``'s path, in bf16 when the checkpoint stores it so (lossless), else f32.

Activations: NVFP4A16 means 16-bit activations; llama.cpp's NVFP4 dot products quantize activations to
8 bits on the CPU and in CUDA's MMQ before Blackwell, and (untagged) to 4 bits, per 16 with its own
scales, on Blackwell's FP4 path. An NVFP4A16 file tags every NVFP4 tensor ``prec_a4 = false``
(``general.tensor_extra.*``), which keeps Blackwell at 8-bit activations too. A W4A4 checkpoint's
static ``input_global_scale`` has no place in llama.cpp's graph: it is dropped, and the manifest says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from clef_gguf.convert import gguf_vocab
from clef_gguf.convert import tensor_map as tm
from clef_gguf.convert.release import PROCESSOR_FILES, copy_file, tower_name
from clef_gguf.convert.vision import write_vision
from clef_gguf.convert.hf_to_gguf import (SUPPORTED, add_metadata, load_config, open_weights, read_json,
                                          scan_checkpoint, stream_gguf, text_dims)
from clef_gguf.core.errors import ConversionError, ModelNotFound
from clef_gguf.formats import files
from clef_gguf.formats.gguf import TOWER_ARCH
from clef_gguf.tower.nvfp4 import format as fmt
from clef_gguf.tower.nvfp4.checkpoint import COMPRESSION

OUTTYPE = "nvfp4-gguf"  # what `convert --outtype` calls it, and the tower file's name
NVFP4 = gguf.GGMLQuantizationType.NVFP4
FILE_TYPE = int(gguf.LlamaFileType.MOSTLY_NVFP4)
BLOCK = 64  # values per block_nvfp4
BLOCK_BYTES = 4 + BLOCK // 2
GROUP = fmt.GROUP  # values per scale (16)
PACKED, SCALE, GLOBAL, INPUT = "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"
# The edits a quantized projection may carry: V-head reorders, rows (dim 0) or whole column groups.
ROW_EDITS = frozenset({"tile_v_rows_of_qkv", "tile_v_rows", "tile_v_heads"})
COLUMN_EDITS = frozenset({"tile_v_cols"})
# What the weights' quantization args must be (compressed-tensors' NVFP4 / NVFP4A16 presets).
WEIGHT_ARGS = {"num_bits": 4, "type": "float", "group_size": GROUP, "strategy": "tensor_group"}
ACTIVATIONS_DROPPED = ("input_global_scale dropped: llama.cpp quantizes activations itself (8-bit on the "
                       "CPU and on GPUs before Blackwell, 4-bit per 16 with its own scales on Blackwell)")


@dataclass(frozen=True)
class Scheme:
    name: str  # NVFP4A16 (weights only) or NVFP4 (W4A4)
    activations: bool


def read_scheme(config: dict, path: Path) -> Scheme:
    """The checkpoint's NVFP4 scheme from ``quantization_config``, every group checked against the
    format's presets; another scheme or group size is refused naming the key."""
    q = config.get("quantization_config")
    where = f"{path}: quantization_config"
    if not isinstance(q, dict):
        raise ConversionError(f"{path} has no quantization_config: not an NVFP4 checkpoint", field="src")
    if q.get("quant_method", "compressed-tensors") != "compressed-tensors" or q.get("format") != COMPRESSION:
        raise ConversionError(f"{where}.format is {q.get('format')!r} ({q.get('quant_method')!r}): only "
                              f"compressed-tensors {COMPRESSION!r} checkpoints re-encode to NVFP4 GGUF", field="src")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConversionError(f"{where}.config_groups is missing or empty", field="src")
    acts = set()
    for gname, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ConversionError(f"{where}.config_groups.{gname}.weights is missing", field="src")
        for key, want in WEIGHT_ARGS.items():
            if weights.get(key) != want:
                raise ConversionError(f"{where}.config_groups.{gname}.weights.{key} is {weights.get(key)!r}, "
                                      f"not {want!r}: not NVFP4 (FP4 codes, a scale per {GROUP})", field="src")
        inputs = group.get("input_activations")
        if inputs is not None and (inputs.get("num_bits"), inputs.get("type")) != (4, "float"):
            raise ConversionError(f"{where}.config_groups.{gname}.input_activations is not FP4", field="src")
        acts.add(inputs is not None)
    if len(acts) > 1:
        raise ConversionError(f"{where}: a mix of W4A4 and W4A16 groups", field="src")
    return Scheme("NVFP4" if acts == {True} else "NVFP4A16", acts == {True})


def is_checkpoint(src: Path) -> bool:
    """Whether ``src`` is a compressed-tensors NVFP4 checkpoint (its config says so)."""
    path = Path(src) / "config.json"
    try:
        q = read_json(path).get("quantization_config") if path.is_file() else None
    except ConversionError:
        return False
    return isinstance(q, dict) and q.get("format") == COMPRESSION


# --------------------------------------------------------------------------- the bits

def ggml_blocks(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """uint8 codes [N, K] (one 4-bit code each) and scale bytes [N, K/16] -> ggml's block_nvfp4 bytes
    [N, K/64 * 36]: per 64 values its 4 scale bytes (sign bit cleared: UE4M3), then each 16-group's
    8 bytes, element j in the low nibble and j + 8 in the high one."""
    n, k = codes.shape
    groups = codes.reshape(n, k // GROUP, GROUP)
    qs = groups[:, :, :8] | (groups[:, :, 8:] << 4)
    blocks = torch.cat([(scales & 0x7F).reshape(n, k // BLOCK, 4), qs.reshape(n, k // BLOCK, BLOCK // 2)], dim=-1)
    return blocks.reshape(n, k // BLOCK * BLOCK_BYTES).numpy()


def from_ggml_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ggml_blocks`' inverse: (codes [N, K], scale bytes [N, K/16])."""
    n = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(n, -1, BLOCK_BYTES)
    scales = blocks[:, :, :4].reshape(n, -1)
    qs = blocks[:, :, 4:].reshape(n, -1, 8)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, -1)
    return codes, scales


def _scale_dims(d: tm.Dims, name: str) -> tm.Dims:
    """``d`` for a column edit of a scale table: one column per 16 values."""
    if d.lin_v_dim % GROUP:
        raise ConversionError(f"{name}: a value head of {d.lin_v_dim} columns is not whole scale groups of {GROUP}")
    return dataclasses.replace(d, lin_v_dim=d.lin_v_dim // GROUP)


def encode_weight(packed: torch.Tensor, scale: torch.Tensor, edits: tuple[str, ...], d: tm.Dims,
                  name: str) -> np.ndarray:
    """One quantized projection as ggml NVFP4 blocks, ``edits`` applied to its codes and scales."""
    codes = fmt.unpack_fp4(packed)
    scale_bytes = scale.view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else scale
    codes = tm.apply_edits(codes, edits, d)
    scale_bytes = tm.apply_edits(scale_bytes, edits, _scale_dims(d, name) if COLUMN_EDITS & set(edits) else d)
    return ggml_blocks(codes.contiguous(), scale_bytes.contiguous())


def second_scale(global_scale: torch.Tensor) -> np.ndarray:
    """llama.cpp's ``<name>.scale``: what it multiplies the matmul's output by, 1 / global_scale (F32 [1])."""
    return (1.0 / global_scale.reshape(1).to(torch.float32)).numpy()


# --------------------------------------------------------------------------- the plan

@dataclass
class Item:
    """One GGUF tensor: a plain one (``source``) or an NVFP4 projection (``module``) or its scale."""

    gguf_name: str
    kind: str  # "plain", "nvfp4", "scale"
    source: str  # checkpoint name (plain), or the module (nvfp4 and scale)
    edits: tuple[str, ...]
    qtype: gguf.GGMLQuantizationType
    layout: tuple[list[int], np.dtype, int]


def _nvfp4_item(name: str, module: str, shape: list[int], found: dict, gg: str,
                edits: tuple[str, ...]) -> list[Item]:
    n, k = shape
    need = {PACKED: ([n, k // 2], "U8"), SCALE: ([n, k // GROUP], "F8_E4M3")}
    for suffix, (want, dtype) in need.items():
        got = found.get(f"{module}.{suffix}")
        if got is None:
            raise ConversionError(f"{module}.{suffix} is missing: {module} is not a whole NVFP4 layer", field="src")
        if got[1] != want or got[2] != dtype:
            raise ConversionError(f"{module}.{suffix} is {got[2]} {got[1]}, expected {dtype} {want} for a "
                                  f"[{n}, {k}] weight with a scale per {GROUP}", field="src")
    glob = found.get(f"{module}.{GLOBAL}")
    if glob is None or int(np.prod(glob[1])) != 1 or glob[2] != "F32":
        raise ConversionError(f"{module}.{GLOBAL} is missing or not one float32", field="src")
    if k % BLOCK:
        raise ConversionError(f"{module}: rows of {k} values are not whole ggml NVFP4 blocks of {BLOCK}", field="src")
    if set(edits) - ROW_EDITS - COLUMN_EDITS:
        raise ConversionError(f"{name}: edits {edits} cannot apply to NVFP4 codes", field="src")
    raw = [n, k // BLOCK * BLOCK_BYTES]
    return [Item(gg, "nvfp4", module, edits, NVFP4, (raw, np.dtype(np.uint8), raw[0] * raw[1])),
            Item(gg.removesuffix(".weight") + ".scale", "scale", module, (), gguf.GGMLQuantizationType.F32,
                 ([1], np.dtype(np.float32), 4))]


def plan(src: Path) -> tuple[dict, dict, tm.Dims, Scheme, list[Item], str]:
    """(config, text config, dims, scheme, every GGUF tensor in order, plain tensors' type)."""
    config, text, arch = load_config(src)
    scheme = read_scheme(config, src / "config.json")
    found = scan_checkpoint(src)
    prefix = SUPPORTED[arch][1]
    quantized = {n[:-len(PACKED) - 1] for n in found if n.endswith("." + PACKED)}
    parts = {f"{m}.{s}" for m in quantized for s in (PACKED, SCALE, GLOBAL, INPUT)}
    text_names, _ = tm.text_names((n for n in found if n not in parts), prefix)
    text_names |= {m[len(prefix):] + ".weight": m for m in quantized if m.startswith(prefix)}
    if len(text_names) != len({*text_names.values()}) or any(not m.startswith(prefix) for m in quantized):
        raise ConversionError(f"{src}: NVFP4 layers outside the text model, or twice", field="src")
    tied = "lm_head.weight" not in text_names and bool(text.get("tie_word_embeddings"))
    d = text_dims(text, tied)
    expected = tm.expected_shapes(d)
    unknown = sorted(set(text_names) - set(expected))
    missing = sorted(set(expected) - set(text_names), key=tm.sort_key)
    if unknown or missing:
        raise ConversionError(f"the checkpoint does not match its config: unexpected {unknown[:3]}, missing "
                              f"{[prefix + m for m in missing[:3]]}", field="src")
    plain = [found[text_names[n]] for n in expected if text_names[n] not in quantized and len(expected[n]) >= 2]
    plain_type = "bf16" if all(dtype == "BF16" for _, _, dtype in plain) else "f32"
    items: list[Item] = []
    for name in sorted(expected, key=tm.sort_key):
        gg, edits = tm.gguf_name(name)
        source = text_names[name]
        if source in quantized:
            items += _nvfp4_item(name, source, expected[name], found, gg, edits)
            continue
        _, shape, dtype = found[source]
        if shape != expected[name] or dtype not in ("BF16", "F16", "F32"):
            raise ConversionError(f"tensor {source!r} is {dtype} {shape}, config implies {expected[name]}", field="src")
        out_shape = tm.output_shape(shape, edits)
        qtype = tm.storage_type(gg, out_shape, plain_type)
        items.append(Item(gg, "plain", source, edits, qtype, tm.encoded_layout(out_shape, qtype)))
    return config, text, d, scheme, items, plain_type


# --------------------------------------------------------------------------- writing

def write_tower(src: Path, path: Path, *, name: str, tokenizer: Path | None = None) -> dict[str, Any]:
    """The NVFP4 tower GGUF of checkpoint ``src`` at ``path`` (whole or not at all); a summary."""
    src = Path(src)
    config, text, d, scheme, items, plain_type = plan(src)
    tokenizer_json = tokenizer or src / files.TOKENIZER
    if not tokenizer_json.is_file():
        raise ModelNotFound(f"no tokenizer.json in {src}", field="src")
    tcfg_path = src / "tokenizer_config.json"
    vocab = gguf_vocab.read_vocab(tokenizer_json, d.vocab, read_json(tcfg_path) if tcfg_path.is_file() else {}, text)
    writer = gguf.GGUFWriter(path=None, arch=TOWER_ARCH)
    add_metadata(writer, text, d, plain_type, name, file_type=FILE_TYPE)
    nvfp4 = [it.gguf_name for it in items if it.kind == "nvfp4"]
    if not scheme.activations:  # keep Blackwell's FP4 path at 8-bit activations, as W4A16 means
        writer.add_array("general.tensor_extra.name", nvfp4)
        writer.add_array("general.tensor_extra.prec_a4", [False] * len(nvfp4))
    gguf_vocab.add_to_writer(writer, vocab)
    for it in items:
        shape, dtype, nbytes = it.layout
        writer.add_tensor_info(it.gguf_name, shape, dtype, nbytes, raw_dtype=it.qtype)
    found = scan_checkpoint(src)

    def payloads() -> Iterator[np.ndarray]:
        with contextlib.ExitStack() as stack:
            handles: dict[Path, Any] = {}

            def tensor(name: str) -> torch.Tensor:
                file = found[name][0]
                if file not in handles:
                    handles[file] = stack.enter_context(open_weights(file))
                return handles[file].tensor(name)

            for it in items:
                if it.kind == "plain":
                    t = tm.apply_edits(tensor(it.source).to(torch.float32), it.edits, d)
                    yield tm.encode(t.numpy(), it.qtype)
                elif it.kind == "nvfp4":
                    yield encode_weight(tensor(f"{it.source}.{PACKED}"), tensor(f"{it.source}.{SCALE}"),
                                        it.edits, d, it.source)
                else:
                    g = tensor(f"{it.source}.{GLOBAL}")
                    if not (torch.isfinite(g).all() and (g > 0).all()):
                        raise ConversionError(f"{it.source}.{GLOBAL} is {g.item()}: not a positive scale", field="src")
                    yield second_scale(g)

    stream_gguf(writer, path, payloads())
    return {"scheme": scheme.name, "nvfp4_tensors": len(nvfp4), "tensors": len(items),
            "other_tensors_type": plain_type, "vocab_size": d.vocab, "tokenizer_tokens": vocab.n_real,
            "activation_scales": ACTIVATIONS_DROPPED if scheme.activations else None,
            "config_sha256": hashlib.sha256((src / "config.json").read_bytes()).hexdigest()}


def convert_checkpoint(src, out, *, name: str | None = None, head_weights: Path | None = None,
                       head_config: Path | None = None, tokenizer: Path | None = None) -> Path:
    """NVFP4 checkpoint directory ``src`` -> the model directory ``out`` (tower GGUF, head files,
    tokenizer, processor and vision files where the checkpoint has them, manifest); all or nothing.
    The head and tokenizer are ``src``'s unless given (a pulled checkpoint takes them from its family)."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise ModelNotFound(f"source directory not found: {src}", field="src")
    given = {files.HEAD_WEIGHTS: head_weights, files.HEAD_CONFIG: head_config, files.TOKENIZER: tokenizer}
    parts = {role: Path(path) if path is not None else src / role for role, path in given.items()}
    for role, path in parts.items():
        if not path.is_file():
            raise ModelNotFound(f"{role} not found ({path})", field="src")
    name = name or src.resolve().name
    tower = tower_name(OUTTYPE)
    with files.staged_directory(out) as stage:
        summary = write_tower(src, stage / tower, name=name, tokenizer=parts[files.TOKENIZER])
        for role, path in parts.items():
            copy_file(path, stage / role)
        for fname in PROCESSOR_FILES:
            if (src / fname).is_file():
                copy_file(src / fname, stage / fname)
        vision = write_vision(src, stage)
        source = {"path": str(src.resolve()), "format": f"compressed-tensors {COMPRESSION}", **summary}
        files.write_manifest(stage, name, OUTTYPE,
                             {"tower": tower, "head_weights": files.HEAD_WEIGHTS,
                              "head_config": files.HEAD_CONFIG, "tokenizer": files.TOKENIZER},
                             extra={"source": source, **({"vision": vision} if vision else {})},
                             also=tuple(vision.values()) if vision else ())
    return out
