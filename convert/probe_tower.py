"""A speed probe's tower: a few decoder layers at a family's exact shapes, in the types a quant gives them.

``clef-gguf pick`` predicts how long a decision takes with each quant before anything is downloaded
(``clef_gguf/pick/speed.py``). A quant's time is its tensors' matmuls at their types and shapes, not their
values, so the probe runs a small file whose layers cost what the real file's layers cost:

1. ``write_skeleton``: the family's whole tensor list (every layer, real names, real row widths and
   hyper-parameters) in bf16, each block matrix cut to two rows, with a small vocabulary. llama.cpp's
   quantizer chooses a tensor's type from its name, its layer, its row width and the model's
   hyper-parameters, never from its row count (``llama_tensor_get_type`` in llama-quant.cpp), so
   the quantizer's dry run on the skeleton names every tensor's type in the published file, in
   milliseconds; ``retyped`` gives each tensor that type (zeros: the values do not matter to time).
   An NVFP4 checkpoint's GGUF is no quantizer's mix: ``nvfp4_retyped`` gives NVFP4 to the projections
   the checkpoint quantizes, with their second scales.
2. ``choose_layers``: which of the model's layers the probe's few layers copy. The mixes give some
   layers more bits (``use_more_bits``: Q4_K_M keeps half the ``ffn_down`` in Q6_K); the chosen ones
   hold, role by role, the bytes closest to the model's average layer of their kind.
3. ``write_probe``: one full-attention interval of layers (3 linear-attention + 1 full-attention for
   Clef-Flash: both kinds in their real ratio) at full shape, each matrix the skeleton's rows in their
   type repeated to the real row count; a matrix of zeros is a hole in the file, not written.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from clef_gguf.convert import gguf_vocab, nvfp4, quantize
from clef_gguf.convert.synthetic import tiny
from clef_gguf.convert import tensor_map as tm
from clef_gguf.convert.synthetic.shapes import plan, preset_config
from clef_gguf.convert.hf_to_gguf import SUPPORTED, add_metadata, stream_gguf, whole_gguf
from clef_gguf.core.errors import ConversionError
from clef_gguf.formats.gguf import ensure_gguf_types

# Rows of the probe's vocabulary: the embedding lookup and the final norm cost nothing next to the
# layers, and the runtime never multiplies by the output matrix (it reads hidden states).
PROBE_VOCAB = 1024
SEED = 0
# An NVFP4 checkpoint re-encoded as a GGUF (``convert.nvfp4_to_gguf``), as ``pick`` names it -> whether its
# activations are 4-bit (W4A4: untagged; W4A16 tags its NVFP4 tensors to keep 8-bit activations).
NVFP4_GGUF = {"NVFP4A16-GGUF": False, "NVFP4-GGUF": True}
SECOND_SCALE = ".scale"  # llama.cpp's per-tensor second scale of an NVFP4 weight, F32 [1]
# Rows of each block matrix in the skeleton: two, because ggml counts a one-row matrix as 1-D and
# llama.cpp leaves 1-D tensors unquantized.
SKELETON_ROWS = 2


def probe_preset(preset: str, layers: int | None = None) -> dict:
    """``preset``'s shapes with the probe's small vocabulary (``layers``: fewer blocks)."""
    p = preset_config(preset, layers)
    return {**p, "vocab_size": min(p["vocab_size"], PROBE_VOCAB)}


@functools.lru_cache(maxsize=2)
def _tokenizer(bpe_vocab: int):
    """The demo tokenizer (trained in ~1 s): once per process, whatever the quants."""
    return tiny.build_tokenizer(bpe_vocab)


def _cut(gguf_name: str, shape: list[int]) -> bool:
    """A matrix the skeleton holds as ``SKELETON_ROWS`` rows: every 2-D weight of a block, and the
    embedding and output matrices (quantizing even a small vocabulary's rows to an IQ type took seconds
    per quant; their type depends on their name only)."""
    named = gguf_name.startswith("blk.") or gguf_name in ("token_embd.weight", "output.weight")
    return named and len(shape) == 2 and shape[0] > 1 and gguf_name.endswith(".weight")


def _metadata_writer(p: dict, tok, tokenizer_json: Path, name: str) -> tuple[gguf.GGUFWriter, tm.Dims, list]:
    text, d, items = plan(p, "bf16", tok)
    vocab = gguf_vocab.read_vocab(tokenizer_json, d.vocab, tiny.tokenizer_config(tok), text)
    writer = gguf.GGUFWriter(path=None, arch="qwen35")
    add_metadata(writer, text, d, "bf16", name)
    gguf_vocab.add_to_writer(writer, vocab)
    return writer, d, [item for item in items if item.gguf_name is not None]


def write_skeleton(path: Path, preset: str, workdir: Path, layers: int | None = None) -> dict:
    """The skeleton bf16 GGUF of ``preset`` (``layers``: that many blocks) at ``path`` (see the module
    doc); returns its summary."""
    p = probe_preset(preset, layers)
    tok = _tokenizer(p["bpe_vocab"])
    tokenizer_json = workdir / "probe-tokenizer.json"
    tok.save(str(tokenizer_json))
    writer, d, items = _metadata_writer(p, tok, tokenizer_json, f"clef-speed-probe-{preset}")
    gen = torch.Generator().manual_seed(SEED)
    payloads = []
    for item in items:
        shape = tm.output_shape(item.shape, item.edits)
        if _cut(item.gguf_name, shape):
            shape = [SKELETON_ROWS, shape[1]]
            kind, scale = item.rule
            values = torch.randn(shape, generator=gen) * scale
        else:  # norms, convolutions, decay rates: as the converter writes them (finite recurrences)
            values = tm.apply_edits(tiny.init_tensor(item.shape, item.rule, gen).to(torch.float32), item.edits, d)
        qtype = tm.storage_type(item.gguf_name, shape, "bf16")
        data = (values.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
                if qtype == gguf.GGMLQuantizationType.BF16 else tm.encode(values.numpy(), qtype))
        layout_shape, dtype, nbytes = tm.encoded_layout(shape, qtype) if qtype != gguf.GGMLQuantizationType.BF16 \
            else (shape, np.dtype(np.int16), data.nbytes)
        writer.add_tensor_info(item.gguf_name, layout_shape, dtype, nbytes, raw_dtype=qtype)
        payloads.append(data)
    stream_gguf(writer, path, payloads)
    return {"layers": p["layers"], "tensors": len(items), "bytes": path.stat().st_size}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a quantized skeleton: its type and its rows' bytes ``[rows, row_bytes]``."""

    qtype: gguf.GGMLQuantizationType
    rows: np.ndarray  # uint8
    dims: tuple[int, ...]  # numpy order (ne reversed)

    @property
    def row_bytes(self) -> int:
        return int(self.rows.shape[1])


def read_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of a GGUF (the skeleton) by name, as raw rows."""
    ensure_gguf_types()  # a quantized skeleton may hold Q2_0, which PyPI gguf cannot name
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        n_rows = int(math.prod(int(n) for n in t.shape[1:])) or 1
        raw = np.asarray(t.data).view(np.uint8).reshape(n_rows, -1)
        dims = tuple(int(n) for n in reversed(t.shape))
        out[t.name] = StoredTensor(gguf.GGMLQuantizationType(int(t.tensor_type)), raw, dims)
    return out


def planned_types(skeleton: Path, quant: str, threads: int = 1) -> dict[str, str]:
    """Tensor name -> the type llama.cpp's quantizer gives it for ``quant`` (catalog spelling): its
    dry run on the skeleton, which writes nothing."""
    import llama_cpp as ll

    if quant not in quantize.QUANT_TYPES:
        raise ValueError(f"{quant} is not a type this llama.cpp build quantizes to")
    ll.llama_backend_init()
    params = ll.llama_model_quantize_default_params()
    params.ftype, params.nthread = quantize.QUANT_TYPES[quant], threads
    planned = quantize.dry_run(ll, {"src": str(skeleton), "dst": str(skeleton.with_suffix(".dry"))}, params)
    if not planned:
        raise RuntimeError(f"llama.cpp's quantizer planned no types for {quant} (its dry run failed)")
    return planned


def quantized(skeleton: Path, quant: str, workdir: Path, threads: int = 1) -> dict[str, StoredTensor]:
    """The skeleton quantized to ``quant`` by llama.cpp (a uniform importance matrix where the type needs
    one): every tensor's rows as the quantizer writes them. For a probe of a whole small tower, whose
    weights then sit in the CPU's cache: there an IQ type's grid lookups cost by their values, and
    zeros (``retyped``) under-stated IQ2 and IQ3 types by ~30% on the ~110M shape."""
    if quant not in quantize.QUANT_TYPES:
        raise ValueError(f"{quant} is not a type this llama.cpp build quantizes to")
    out = workdir / f"skeleton-{quant}.gguf"
    try:  # flat weights where the type needs an importance matrix: the values do not matter to the time
        quantize.quantize_file(skeleton, out, quant, threads=threads,
                               imatrix="uniform" if quant in quantize.NEEDS_IMATRIX else None)
        # copies: the rows outlive the file
        return {name: StoredTensor(t.qtype, t.rows.copy(), t.dims) for name, t in read_tensors(out).items()}
    finally:
        out.unlink(missing_ok=True)


def retyped(skeleton: dict[str, StoredTensor], planned: dict[str, str]) -> dict[str, StoredTensor]:
    """The skeleton with each tensor in the type ``planned`` names (llama.cpp's quantizer's dry run for
    a quant; nothing planned: the skeleton's own, the bf16 probe): rows of zeros of that type, but for
    the F32 tensors, kept as they are (norms, convolutions, decay rates). A matmul's time is its type
    and shape, not its values (measured at Clef-Flash's shape, 128-token prefills, median of 4: a
    probe of zeros took 0.93-1.05x the time of one of quantized random weights for Q4_K_M, Q8_0,
    IQ2_XS, Q6_K, IQ4_XS and Q5_1); quantizing would cost the probe the IQ types' grid set-up, ~16 s
    of it."""
    ensure_gguf_types()  # Q2_0 is not in PyPI gguf's tables
    out = {}
    for name, t in skeleton.items():
        kind = planned.get(name, t.qtype.name)
        if kind == t.qtype.name == "F32":  # norms, convolutions, decay rates: their values, as written
            out[name] = t
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        width = t.dims[-1]
        if width % block:
            raise ConversionError(f"{name}: rows of {width} do not hold whole {kind} blocks of {block}")
        out[name] = StoredTensor(qtype, np.zeros((len(t.rows), width // block * size), np.uint8), t.dims)
    return out


def nvfp4_retyped(skeleton: dict[str, StoredTensor], preset: str) -> dict[str, StoredTensor]:
    """The skeleton as an NVFP4 checkpoint's GGUF holds it: every projection the checkpoint quantizes
    (``convert.nvfp4.is_target``) an NVFP4 tensor of zeros with its second scale (1.0) beside it, the rest
    as the bf16 skeleton has it (the checkpoint keeps embeddings, the GDN gates' small projections and
    the norms in bf16 or f32). No quantizer runs: ``convert.nvfp4_to_gguf`` re-encodes, it never chooses."""
    p = probe_preset(preset)
    prefix = SUPPORTED["Qwen3_5ForConditionalGeneration"][1]
    _, _, items = plan(p, "bf16", _tokenizer(p["bpe_vocab"]))
    planned = {it.gguf_name: "NVFP4" for it in items if it.gguf_name and nvfp4.is_target(it.hf_name, prefix)}
    if not planned:
        raise ConversionError(f"preset {preset}: no projection an NVFP4 checkpoint quantizes")
    out = retyped(skeleton, planned)
    one = np.array([1.0], np.float32).view(np.uint8).reshape(1, 4)
    for name in planned:
        out[name.removesuffix(".weight") + SECOND_SCALE] = StoredTensor(gguf.GGMLQuantizationType.F32, one, (1,))
    return out


def _layer_kinds(p: dict) -> list[str]:
    return ["full" if (i + 1) % p["interval"] == 0 else "linear" for i in range(p["layers"])]


def choose_layers(stored: dict[str, StoredTensor], preset: str, probe_layers: int) -> list[int]:
    """For each of the probe's ``probe_layers`` layers, the model layer (of the same kind) it copies.

    Per kind, the chosen layers' bytes per role (``attn_qkv``, ``ffn_down``, ...) at full row count
    are closest, in summed relative error, to as many of the model's average layer of that kind. A
    probe of every layer copies each as it is."""
    full = preset_config(preset)
    if probe_layers == full["layers"]:
        return list(range(probe_layers))
    _, _, items = plan(probe_preset(preset), "bf16", _tokenizer(full["bpe_vocab"]))
    rows = {it.gguf_name.split(".", 2)[2]: tm.output_shape(it.shape, it.edits)[0]
            for it in items if it.gguf_name and it.gguf_name.startswith("blk.")
            and _cut(it.gguf_name, tm.output_shape(it.shape, it.edits))}
    kinds = _layer_kinds(full)

    def role_bytes(layer: int) -> dict[str, int]:
        out = {}
        for role, n in rows.items():
            t = stored.get(f"blk.{layer}.{role}")
            if t is not None:
                out[role] = t.row_bytes * n
        return out

    per_layer = [role_bytes(i) for i in range(full["layers"])]
    probe_kinds = _layer_kinds({**full, "layers": probe_layers})
    chosen: dict[str, list[int]] = {}
    for kind in ("linear", "full"):
        pool = [i for i, k in enumerate(kinds) if k == kind]
        count = probe_kinds.count(kind)
        if not count:
            continue
        roles = sorted({r for i in pool for r in per_layer[i]})
        mean = {r: sum(per_layer[i].get(r, 0) for i in pool) / len(pool) for r in roles}

        def error(combo: tuple[int, ...]) -> float:
            return sum(abs(sum(per_layer[i].get(r, 0) for i in combo) - count * mean[r]) / (count * mean[r])
                       for r in roles if mean[r])
        # Layers with equal byte profiles are interchangeable: search one of each profile.
        distinct = list({tuple(sorted(per_layer[i].items())): i for i in pool}.values())
        best = min(itertools.combinations_with_replacement(distinct, count), key=error)
        chosen[kind] = list(best)
    return [chosen[k].pop(0) for k in probe_kinds]


def write_probe(path: Path, stored: dict[str, StoredTensor], preset: str, sources: list[int],
                workdir: Path, *, nvfp4_a16: bool = False) -> dict:
    """The probe GGUF: ``len(sources)`` layers of ``preset`` at full shape, layer ``i`` in the types
    (and the quantized rows, repeated) of the skeleton's layer ``sources[i]``, an NVFP4 tensor's second
    scale beside it; ``nvfp4_a16``: its NVFP4 tensors tagged for 8-bit activations, as a W4A16
    checkpoint's GGUF tags them (``convert.nvfp4_to_gguf``). Returns its summary."""
    p = probe_preset(preset, len(sources))
    tok = _tokenizer(p["bpe_vocab"])
    tokenizer_json = workdir / "probe-tokenizer.json"
    tok.save(str(tokenizer_json))
    writer, _, items = _metadata_writer(p, tok, tokenizer_json, f"clef-speed-probe-{preset}")

    def source(name: str) -> StoredTensor | None:
        if name.startswith("blk."):
            _, layer, role = name.split(".", 2)
            return stored.get(f"blk.{sources[int(layer)]}.{role}")
        return stored.get(name)

    tensors = []  # (name, source, rows it gets)
    for item in items:
        name = item.gguf_name
        src = source(name)
        if src is None:
            raise ConversionError(f"the quantized skeleton has no tensor for {name}")
        shape = tm.output_shape(item.shape, item.edits)
        tensors.append((name, src, shape[0] if _cut(name, shape) else None))
        scale = source(name.removesuffix(".weight") + SECOND_SCALE)
        if scale is not None and src.qtype == gguf.GGMLQuantizationType.NVFP4:
            tensors.append((name.removesuffix(".weight") + SECOND_SCALE, scale, None))
    fp4 = [name for name, src, _ in tensors if src.qtype == gguf.GGMLQuantizationType.NVFP4]
    if nvfp4_a16 and fp4:
        writer.add_array("general.tensor_extra.name", fp4)
        writer.add_array("general.tensor_extra.prec_a4", [False] * len(fp4))
    parts = []  # (rows, count): tiled to ``count`` rows only as the file is written
    for name, src, rows in tensors:
        if rows is not None:
            parts.append((src.rows, rows))
            dims = [rows, src.row_bytes]
        else:
            parts.append((src.rows, len(src.rows)))
            dims = [*src.dims[:-1], src.row_bytes]
        writer.add_tensor_info(name, dims, np.dtype(np.uint8), parts[-1][1] * src.row_bytes, raw_dtype=src.qtype)
    _write_sparse(writer, path, parts)
    return {"layers": len(sources), "sources": sources, "bytes": path.stat().st_size}


def _write_sparse(writer: gguf.GGUFWriter, path: Path, parts: list[tuple[np.ndarray, int]]) -> None:
    """The GGUF's header from ``writer``, then each tensor's rows tiled to its count, at the offsets
    ``write_ti_data_to_file`` gave them (each padded to the alignment). A tensor whose rows are all
    zeros (``retyped``'s) is left a hole the file system reads back as zeros: a Clef-Flash probe is up
    to 1.7 GB, and tiling and writing it cost ~0.6 s per quant (BF16 7.6 s, on a 2-core AVX2 VM); a
    hole costs ~10 ms (llama.cpp's load then maps zero pages: BF16's 2.5-3.4 s). The file appears
    under its name only when complete (``whole_gguf``)."""
    align = writer.data_alignment
    with whole_gguf(writer, path) as tmp:
        writer.close()  # the header is out; the tensors go at their offsets below
        with open(tmp, "r+b") as f:
            offset = gguf.GGUFWriter.ggml_pad(f.seek(0, 2), align)
            for rows, count in parts:  # one tensor in memory at a time
                if rows.any():
                    f.seek(offset)
                    full = rows if count == len(rows) else np.tile(rows, (-(-count // len(rows)), 1))[:count]
                    f.write(np.ascontiguousarray(full).data)
                offset += gguf.GGUFWriter.ggml_pad(count * rows.shape[1], align)
            f.truncate(offset)  # the last tensors may be holes, and GGUF pads the data's end too
