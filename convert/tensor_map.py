"""Hugging Face Qwen3.5 text tensors -> llama.cpp ``qwen35`` tensors: names, shapes, edits, storage types.

Everything the converter knows about tensors is in the tables below; ``hf_to_gguf`` only walks them.
Names are "text-relative": the checkpoint prefix (``model.language_model.`` for the VL release,
``model.`` for a text-only ``Qwen3_5ForCausalLM``) is stripped first; ``lm_head.weight`` has none.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import gguf
import numpy as np
import torch

from clef_gguf.core.errors import ConversionError

GLOBAL_NAMES = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# (HF suffix inside ``layers.N.``, GGUF suffix inside ``blk.N.``, edits applied in order).
# Edit names refer to the functions in ``EDITS``; see there for why each exists.
LAYER_TABLE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("input_layernorm.weight", "attn_norm.weight", ("plus_one",)),
    ("post_attention_layernorm.weight", "post_attention_norm.weight", ("plus_one",)),
    # Full attention. q_proj holds [query | gate] per head, the layout llama.cpp views directly.
    ("self_attn.q_proj.weight", "attn_q.weight", ()),
    ("self_attn.k_proj.weight", "attn_k.weight", ()),
    ("self_attn.v_proj.weight", "attn_v.weight", ()),
    ("self_attn.o_proj.weight", "attn_output.weight", ()),
    ("self_attn.q_norm.weight", "attn_q_norm.weight", ("plus_one",)),
    ("self_attn.k_norm.weight", "attn_k_norm.weight", ("plus_one",)),
    # Gated DeltaNet (linear attention).
    ("linear_attn.in_proj_qkv.weight", "attn_qkv.weight", ("tile_v_rows_of_qkv",)),
    ("linear_attn.in_proj_z.weight", "attn_gate.weight", ("tile_v_rows",)),
    ("linear_attn.in_proj_b.weight", "ssm_beta.weight", ("tile_v_heads",)),
    ("linear_attn.in_proj_a.weight", "ssm_alpha.weight", ("tile_v_heads",)),
    ("linear_attn.conv1d.weight", "ssm_conv1d.weight", ("squeeze_conv", "tile_v_rows_of_qkv")),
    ("linear_attn.dt_bias", "ssm_dt.bias", ("tile_v_heads",)),
    ("linear_attn.A_log", "ssm_a", ("tile_v_heads", "neg_exp")),
    # The gated norm is a plain (1-centred) RMSNorm over one head: no +1, no reordering.
    ("linear_attn.norm.weight", "ssm_norm.weight", ()),
    ("linear_attn.out_proj.weight", "ssm_out.weight", ("tile_v_cols",)),
    ("mlp.gate_proj.weight", "ffn_gate.weight", ()),
    ("mlp.up_proj.weight", "ffn_up.weight", ()),
    ("mlp.down_proj.weight", "ffn_down.weight", ()),
)
_LAYER_INDEX = {hf: (gg, edits) for hf, gg, edits in LAYER_TABLE}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")

# Checkpoint parts that are not the language tower: skipped on purpose, never an error.
SKIP_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")

# Written as F32 whatever the outtype, as llama.cpp's converter does: the conv kernel (ggml's
# ssm_conv needs it) and anything that is not a matmul ``.weight`` (ssm_a, ssm_dt.bias).
_ALWAYS_F32 = ("ssm_conv1d.weight",)


@dataclass
class Dims:
    """The text-config numbers the tensor shapes depend on."""

    hidden: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    layer_types: list[str] = field(default_factory=list)
    tied: bool = False

    @property
    def v_per_k(self) -> int:
        return self.lin_v_heads // self.lin_k_heads


def expected_shapes(d: Dims) -> dict[str, list[int]]:
    """Every text-relative tensor name the config implies, with its Hugging Face shape."""
    H, F = d.hidden, d.ffn
    kd, vd = d.lin_k_heads * d.lin_k_dim, d.lin_v_heads * d.lin_v_dim
    nq, nkv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = {"embed_tokens.weight": [d.vocab, H], "norm.weight": [H]}
    if not d.tied:
        out["lm_head.weight"] = [d.vocab, H]
    for i, kind in enumerate(d.layer_types):
        shapes = {"input_layernorm.weight": [H], "post_attention_layernorm.weight": [H],
                  "mlp.gate_proj.weight": [F, H], "mlp.up_proj.weight": [F, H],
                  "mlp.down_proj.weight": [H, F]}
        if kind == "full_attention":
            shapes |= {"self_attn.q_proj.weight": [2 * nq, H], "self_attn.k_proj.weight": [nkv, H],
                       "self_attn.v_proj.weight": [nkv, H], "self_attn.o_proj.weight": [H, nq],
                       "self_attn.q_norm.weight": [d.head_dim], "self_attn.k_norm.weight": [d.head_dim]}
        else:
            shapes |= {"linear_attn.in_proj_qkv.weight": [2 * kd + vd, H],
                       "linear_attn.in_proj_z.weight": [vd, H],
                       "linear_attn.in_proj_b.weight": [d.lin_v_heads, H],
                       "linear_attn.in_proj_a.weight": [d.lin_v_heads, H],
                       "linear_attn.conv1d.weight": [2 * kd + vd, 1, d.conv_kernel],
                       "linear_attn.dt_bias": [d.lin_v_heads], "linear_attn.A_log": [d.lin_v_heads],
                       "linear_attn.norm.weight": [d.lin_v_dim],
                       "linear_attn.out_proj.weight": [H, vd]}
        out |= {f"layers.{i}.{k}": v for k, v in shapes.items()}
    return out


def gguf_name(name: str) -> tuple[str, tuple[str, ...]]:
    """GGUF name and edit list of a text-relative HF name; ConversionError if it is not in the tables."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name], ("plus_one",) if name == "norm.weight" else ()
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_INDEX:
        gg, edits = _LAYER_INDEX[m.group(2)]
        return f"blk.{m.group(1)}.{gg}", edits
    raise ConversionError(f"unknown tensor {name!r}: not part of the Qwen3.5 text model this converter maps")


def text_names(names: Iterable[str], prefix: str) -> tuple[dict[str, str], int]:
    """(text-relative name -> checkpoint name of every text tensor in ``names``, how many vision/MTP
    tensors were skipped): ``lm_head.weight`` as it is, the others under ``prefix`` with it stripped;
    ConversionError naming any other tensor."""
    found: dict[str, str] = {}
    skipped = 0
    for name in names:
        if name.startswith(SKIP_PREFIXES):
            skipped += 1
        elif name == "lm_head.weight":
            found[name] = name
        elif name.startswith(prefix):
            found[name[len(prefix):]] = name
        else:
            raise ConversionError(f"unknown tensor {name!r} (expected the {prefix!r} prefix, "
                                  f"lm_head, or a skipped vision/MTP part)", field="src")
    return found, skipped


def sort_key(name: str) -> tuple:
    """Canonical write order: globals first, then blocks by index, each in table order."""
    m = _LAYER_RE.match(name)
    if not m:
        return (-1, list(GLOBAL_NAMES).index(name))
    return (int(m.group(1)), [hf for hf, _, _ in LAYER_TABLE].index(m.group(2)))


# --------------------------------------------------------------------------- edits

def _tile(t: torch.Tensor, dim: int, d: Dims, head_dim: int) -> torch.Tensor:
    """Reorder V heads from grouped-by-K-head to tiled order along ``dim``.

    HF stores value heads grouped by the key head they share, [k0v0, k0v1, k1v0, k1v1];
    llama.cpp broadcasts K over V heads with ggml's tiled repeat, so it expects
    [k0v0, k1v0, k0v1, k1v1]. Swapping the (k, v) axes converts one into the other.
    """
    if d.lin_v_heads == d.lin_k_heads:
        return t
    shape = list(t.shape)
    split = shape[:dim] + [d.lin_k_heads, d.v_per_k, head_dim] + shape[dim + 1:]
    return t.reshape(split).transpose(dim, dim + 1).contiguous().reshape(shape)


def _tile_v_rows_of_qkv(t: torch.Tensor, d: Dims) -> torch.Tensor:
    # Rows are [q | k | v]; only the v block has per-value-head order.
    kd = 2 * d.lin_k_heads * d.lin_k_dim
    return torch.cat([t[:kd], _tile(t[kd:], 0, d, d.lin_v_dim)], dim=0)


EDITS = {
    # Qwen3.5 RMSNorms scale by (1 + w); llama.cpp's RMSNorm scales by w.
    "plus_one": lambda t, d: t + 1.0,
    # llama.cpp multiplies softplus(...) by ssm_a directly: store A = -exp(A_log).
    "neg_exp": lambda t, d: -torch.exp(t),
    # nn.Conv1d keeps a singleton in-channel axis; ggml's ssm_conv wants [channels, kernel].
    "squeeze_conv": lambda t, d: t.squeeze(1),
    "tile_v_rows_of_qkv": _tile_v_rows_of_qkv,
    "tile_v_rows": lambda t, d: _tile(t, 0, d, d.lin_v_dim),
    "tile_v_heads": lambda t, d: _tile(t, 0, d, 1),
    "tile_v_cols": lambda t, d: _tile(t, 1, d, d.lin_v_dim),
}


def apply_edits(t: torch.Tensor, edits: tuple[str, ...], d: Dims,
                skip: frozenset[str] = frozenset()) -> torch.Tensor:
    for edit in edits:
        if edit not in skip:
            t = EDITS[edit](t, d)
    return t


def output_shape(hf_shape: list[int], edits: tuple[str, ...]) -> list[int]:
    return [s for k, s in enumerate(hf_shape) if not ("squeeze_conv" in edits and k == 1)]


# --------------------------------------------------------------------------- storage types

OUTTYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


def storage_type(name: str, shape: list[int], outtype: str) -> gguf.GGMLQuantizationType:
    """The GGML type one tensor is written in, following llama.cpp's converter."""
    F32 = gguf.GGMLQuantizationType.F32
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return F32  # 1-D tensors and norms: ggml's kernels for them are F32-only
    if name.endswith(_ALWAYS_F32):
        return F32
    qtype = OUTTYPES[outtype][0]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        return gguf.GGMLQuantizationType.F16  # rows that do not fill whole blocks, as llama.cpp does
    return qtype


def encode(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 array -> the bytes/array GGUFWriter writes for ``qtype``."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def encoded_layout(shape: list[int], qtype: gguf.GGMLQuantizationType) -> tuple[list[int], np.dtype, int]:
    """(shape as GGUFWriter wants it, numpy dtype, nbytes) of ``encode``'s result, without encoding."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return shape, np.dtype(np.float32), int(np.prod(shape)) * 4
    if qtype == gguf.GGMLQuantizationType.F16:
        return shape, np.dtype(np.float16), int(np.prod(shape)) * 2
    byte_shape = list(gguf.quant_shape_to_byte_shape(tuple(shape), qtype))
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape))
