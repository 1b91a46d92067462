"""A random Clef tower written directly in its published type, at disk speed (for timing runs).

Every matrix is a pool of ``POOL_ROWS`` random rows already in its stored type, tiled to its row count as
the file is written: no bf16 intermediate, no quantizer run. The types are the real file's: a llama.cpp
quant's per-tensor mix (Q4_K_M keeps the output matrix and some ``ffn_down`` in Q6_K...) comes from the
quantizer's dry run on the speed probe's skeleton (``convert.probe_tower``), which writes nothing; f32,
f16, bf16 and q8_0 follow the converter (``tensor_map.storage_type``); ``nvfp4`` is an NVFP4 checkpoint's
GGUF (``convert.nvfp4_to_gguf``): the projections NVFP4 with a second scale, the rest bf16.

A block's bytes are random but for its scale fields, set so that the values are finite, not all alike and
about the size of the random release's (|w| <= ~0.05): the head answers ordinary probabilities. The 1-D
tensors (norms, decay rates, convolutions) are drawn as ``convert.synthetic.tiny`` draws them.
RANDOM WEIGHTS: the answers mean nothing.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from clef_gguf.convert import gguf_vocab, nvfp4, probe_tower, quantize
from clef_gguf.convert import tensor_map as tm
from clef_gguf.convert.hf_to_gguf import SUPPORTED, add_metadata, whole_gguf
from clef_gguf.convert.nvfp4_to_gguf import BLOCK_BYTES as NVFP4_BLOCK_BYTES
from clef_gguf.core.limits import MiB
from clef_gguf.convert.nvfp4_to_gguf import FILE_TYPE as NVFP4_FILE_TYPE
from clef_gguf.convert.synthetic import tiny
from clef_gguf.convert.synthetic.shapes import plan, preset_config
from clef_gguf.core.errors import ConversionError
from clef_gguf.formats.gguf import ensure_gguf_types

NVFP4 = "nvfp4"  # the outtype naming an NVFP4 checkpoint's GGUF
# Distinct random rows per matrix (prime: a row never lines up with a head or block period of the shapes)
POOL_ROWS = 61
CHUNK_BYTES = 32 * MiB  # bytes of tiled rows made once and written as often as the tensor needs
_T = gguf.GGMLQuantizationType
# ggml block type -> (byte offset, f16 value) of each scale field of its block (ggml-common.h); the rest
# of a block is random bits, every pattern of which is a valid code. The values give |w| <= ~0.05.
SCALE_FIELDS: dict[_T, tuple[tuple[int, float], ...]] = {
    _T.Q4_0: ((0, 4e-3),), _T.Q4_1: ((0, 3e-3), (2, -2e-2)), _T.Q5_0: ((0, 2e-3),),
    _T.Q5_1: ((0, 1.5e-3), (2, -2e-2)), _T.Q8_0: ((0, 2.5e-4),), _T.Q2_K: ((80, 1e-3), (82, 1e-3)),
    _T.Q3_K: ((108, 2e-4),), _T.Q4_K: ((0, 5e-5), (2, 5e-5)), _T.Q5_K: ((0, 2.5e-5), (2, 2.5e-5)),
    _T.Q6_K: ((208, 1e-5),), _T.IQ4_NL: ((0, 2.5e-4),), _T.IQ4_XS: ((0, 1e-5),),
}
NVFP4_SCALE_BYTE = 0x38  # UE4M3 1.0: each 16-value group's scale
NVFP4_SECOND_SCALE = 5e-3  # the tensor's scale: E2M1 codes (|c| <= 6) x 1.0 x this


def random_rows(qtype: _T, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` random rows of ``width`` values in ``qtype``: uint8 ``[rows, row_bytes]``."""
    if qtype in (_T.F32, _T.F16, _T.BF16):
        values = rng.standard_normal((rows, width), dtype=np.float32) * 0.02
        if qtype == _T.BF16:
            return torch.from_numpy(values).to(torch.bfloat16).view(torch.uint8).numpy().reshape(rows, -1)
        return values.astype(np.float16 if qtype == _T.F16 else np.float32).view(np.uint8).reshape(rows, -1)
    fields: tuple[tuple[int, float], ...] = ()
    if qtype == _T.NVFP4:
        block_values, block_bytes = 64, NVFP4_BLOCK_BYTES
    elif qtype in SCALE_FIELDS:
        (block_values, block_bytes), fields = gguf.GGML_QUANT_SIZES[qtype], SCALE_FIELDS[qtype]
    else:
        raise ConversionError(f"random {qtype.name} blocks are not written here: choose a type whose mix "
                              f"holds only {', '.join(t.name for t in SCALE_FIELDS)}, NVFP4 or floats")
    if width % block_values:
        raise ConversionError(f"rows of {width} values do not hold whole {qtype.name} blocks of {block_values}")
    blocks = rng.integers(0, 256, size=(rows, width // block_values, block_bytes), dtype=np.uint8)
    if qtype == _T.NVFP4:
        blocks[:, :, :4] = NVFP4_SCALE_BYTE
    for offset, value in fields:
        blocks[:, :, offset:offset + 2] = np.array([value], np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def planned_types(preset: str, layers: int | None, outtype: str, workdir: Path) -> dict[str, str]:
    """GGUF tensor name -> type name for a tower of ``preset`` (``layers`` blocks) in ``outtype``."""
    p = preset_config(preset, layers)
    _, _, items = plan(p, "bf16", probe_tower._tokenizer(p["bpe_vocab"]))
    stored = [(it.gguf_name, tm.output_shape(it.shape, it.edits), it.hf_name) for it in items if it.gguf_name]
    if outtype in tm.OUTTYPES:
        return {name: tm.storage_type(name, shape, outtype).name for name, shape, _ in stored}
    if outtype == NVFP4:
        prefix = SUPPORTED["Qwen3_5ForConditionalGeneration"][1]
        return {name: "NVFP4" if nvfp4.is_target(hf, prefix) else tm.storage_type(name, shape, "bf16").name
                for name, shape, hf in stored}
    skeleton = workdir / "skeleton-bf16.gguf"
    probe_tower.write_skeleton(skeleton, preset, workdir, layers=layers)
    return probe_tower.planned_types(skeleton, outtype)


def _file_type(outtype: str) -> int:
    if outtype in tm.OUTTYPES:
        return int(tm.OUTTYPES[outtype][1])
    return NVFP4_FILE_TYPE if outtype == NVFP4 else quantize.QUANT_TYPES[outtype]


def canonical(outtype: str) -> str:
    """``outtype`` as this writer spells it (f16, q8_0, Q4_K_M, nvfp4), or the converter's refusal."""
    return NVFP4 if outtype.lower() == NVFP4 else quantize.canonical_outtype(outtype)


def write_tiled_tower(path: Path, *, preset: str = "flash9b", outtype: str = "Q4_K_M", seed: int = 0,
                      layers: int | None = None, tokenizer_json: Path | None = None,
                      name: str | None = None) -> dict:
    """The random tower GGUF of ``preset`` in ``outtype`` at ``path`` (whole or not at all); a summary."""
    ensure_gguf_types()
    outtype = canonical(outtype)
    p = preset_config(preset, layers)
    start = time.perf_counter()
    tok = probe_tower._tokenizer(p["bpe_vocab"])
    with tempfile.TemporaryDirectory(prefix=".clef-tiled-", dir=Path(path).parent) as work:
        if tokenizer_json is None:
            tokenizer_json = Path(work) / "tokenizer.json"
            tok.save(str(tokenizer_json))
        types = planned_types(preset, layers, outtype, Path(work))
        text, d, items = plan(p, "bf16", tok)
        vocab = gguf_vocab.read_vocab(Path(tokenizer_json), d.vocab, tiny.tokenizer_config(tok), text)
    writer = gguf.GGUFWriter(path=None, arch="qwen35")
    add_metadata(writer, text, d, "bf16", name or f"clef-random-{preset}-{outtype}-seed{seed}",
                 file_type=_file_type(outtype))
    gguf_vocab.add_to_writer(writer, vocab)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    parts: list[tuple[np.ndarray, int]] = []  # (pool of rows, rows the tensor has)
    for item in items:
        name = item.gguf_name
        if name is None:
            continue  # a vision or MTP tensor: not in the tower
        shape = tm.output_shape(item.shape, item.edits)
        qtype = gguf.GGMLQuantizationType[types[name]]
        if len(shape) == 2 and qtype != _T.F32:
            pool = random_rows(qtype, min(POOL_ROWS, shape[0]), shape[1], rng)
            parts.append((pool, shape[0]))
            writer.add_tensor_info(name, [shape[0], pool.shape[1]], np.dtype(np.uint8),
                                   shape[0] * pool.shape[1], raw_dtype=qtype)
            if qtype == _T.NVFP4:
                second = np.array([NVFP4_SECOND_SCALE], np.float32).view(np.uint8).reshape(1, 4)
                parts.append((second, 1))
                writer.add_tensor_info(name.removesuffix(".weight") + probe_tower.SECOND_SCALE, [1],
                                       np.dtype(np.float32), 4, raw_dtype=_T.F32)
            continue
        # norms, decay rates, convolutions: small, drawn and edited as the converter writes them
        values = tm.apply_edits(tiny.init_tensor(item.shape, item.rule, gen).to(torch.float32), item.edits, d)
        data = np.ascontiguousarray(values.numpy(), dtype=np.float32)
        if qtype != _T.F32:
            raise ConversionError(f"{name}: a {len(shape)}-D tensor planned {qtype.name}, not F32")
        rows = data.reshape(-1, shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
        parts.append((rows.view(np.uint8), len(rows)))
        writer.add_tensor_info(name, list(shape), np.dtype(np.float32), data.nbytes, raw_dtype=_T.F32)
    _write_tiled(writer, Path(path), parts)
    return {"outtype": outtype, "tensors": len(parts), "bytes": Path(path).stat().st_size,
            "tensor_types": dict(sorted(_count(types).items())),
            "seconds": round(time.perf_counter() - start, 1)}


def _count(types: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind in types.values():
        out[kind] = out.get(kind, 0) + 1
    return out


def _write_tiled(writer: gguf.GGUFWriter, path: Path, parts: list[tuple[np.ndarray, int]]) -> None:
    """The header, then each tensor's pool tiled to its row count, each padded to the alignment; one
    chunk of tiled rows is made per tensor and written as often as it fits."""
    align = writer.data_alignment
    with whole_gguf(writer, path) as tmp:
        writer.close()  # the header is out; the tensors follow at their padded offsets
        with open(tmp, "r+b") as f:
            offset = gguf.GGUFWriter.ggml_pad(f.seek(0, 2), align)
            for pool, count in parts:
                f.seek(offset)
                per_chunk = max(1, CHUNK_BYTES // (pool.nbytes or 1)) * len(pool)
                chunk = np.ascontiguousarray(np.tile(pool, (-(-min(per_chunk, count) // len(pool)), 1)))
                done = 0
                while done < count:
                    n = min(len(chunk), count - done)
                    f.write(chunk[:n].data)
                    done += n
                offset += gguf.GGUFWriter.ggml_pad(count * pool.shape[1], align)
                f.write(b"\0" * (offset - f.tell()))
            f.truncate(offset)


def values_of(qtype: _T, raw: np.ndarray) -> np.ndarray:
    """Rows in ``qtype`` back to float32 values (gguf-py's dequantizers), to check what was written."""
    if qtype == _T.NVFP4:
        from clef_gguf.convert.nvfp4_to_gguf import from_ggml_blocks

        codes, scales = from_ggml_blocks(raw)
        e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6])
        scale = scales.view(torch.float8_e4m3fn).to(torch.float32).repeat_interleave(16, dim=1)
        return (e2m1[codes.long()] * scale).numpy() * NVFP4_SECOND_SCALE
    return gguf.quants.dequantize(raw, qtype).astype(np.float32)
