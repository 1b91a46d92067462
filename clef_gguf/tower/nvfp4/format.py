"""The NVFP4 number format in plain torch (CPU or CUDA), as compressed-tensors writes it.

A weight W [N, K] is stored as E2M1 codes (two per byte, element 2j in the low nibble), one e4m3
scale per row and 16-element block, and one fp32 global scale g per tensor:

    W[n, k] = E2M1(code[n, k]) * scale[n, k // 16] / g

g is an *encode* scale (448 * 6 / amax(|W|)): it stretches the block scales over e4m3's range, so
decoding divides by it. Activations of a W4A4 layer are quantized the same way at run time, with
block scales computed per row from the data and a calibrated global scale.

Quantization follows compressed-tensors 0.20 operation by operation (block scale
``e4m3(g * (amax / 6))``, a zero scale replaced by e4m3's epsilon, codes from ``x / (scale / g)``),
so codes and scales are bit-identical to its ``calculate_qparams`` + ``quantize`` of the same fp32
tensor (and its activation fake-quant of fp32 activations).
Decoding multiplies code by scale (exact in fp32) and divides by g once: the correctly rounded fp32
value of the format, which compressed-tensors' ``code * (scale / g)`` can miss by one ulp.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

GROUP = 16
FP4_MAX = 6.0
E4M3_MAX = 448.0

# Bit 3 is the sign; bits 0-2 index the magnitudes. Code 8 is -0.0.
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
E2M1_VALUES = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
# Halfway points between neighbouring magnitudes: a value on one rounds to the even code of the two.
_MIDPOINTS = (E2M1_MAGNITUDES[1:] + E2M1_MAGNITUDES[:-1]) / 2
# One packed byte -> its two values (low nibble first): one lookup per byte when decoding.
_BYTE_PAIRS = torch.stack([E2M1_VALUES[torch.arange(256) & 0x0F], E2M1_VALUES[torch.arange(256) >> 4]], dim=-1)
# compressed-tensors replaces a zero block scale by finfo(float8_e4m3fn).eps (0.125): codes of an
# all-zero block are 0 whatever the scale, and the scale never divides by zero.
ZERO_SCALE = 0.125


def _e4m3_table() -> torch.Tensor:
    """All 256 e4m3fn bytes as float32: sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0;
    exponent 0 is subnormal (m * 2^-9); 0x7F and 0xFF are NaN; no infinities."""
    byte = torch.arange(256, dtype=torch.int64)
    sign = torch.where((byte & 0x80) != 0, -1.0, 1.0).double()
    exponent, mantissa = (byte >> 3) & 0x0F, (byte & 0x07).double()
    magnitude = torch.where(exponent == 0, mantissa * 2.0 ** -9,
                            (1 + mantissa / 8) * torch.pow(2.0, (exponent - 7).double()))
    nan = (byte & 0x7F) == 0x7F
    return torch.copysign(magnitude.masked_fill(nan, float("nan")), sign).float()


E4M3_TABLE = _e4m3_table()


@functools.lru_cache(maxsize=None)
def _on(table_name: str, device: torch.device) -> torch.Tensor:
    """A lookup table copied once per device instead of once per call."""
    return globals()[table_name].to(device)


# --------------------------------------------------------------------------- codes and bytes

def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> bytes [..., K/2]: element 2j in the low nibble, 2j+1 in the high one."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs uint8 codes with an even last dimension, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., K/2] -> uint8 codes [..., K]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4 needs uint8 bytes, got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code of each value, clamped to +-6, ties to the even code; the sign bit is x's
    (so -0.0 and negative values that round to zero give code 8)."""
    magnitude = x.abs().float().clamp(max=FP4_MAX)
    midpoints = _on("_MIDPOINTS", magnitude.device)
    below = torch.bucketize(magnitude, midpoints, out_int32=True)  # midpoints < |x|
    upto = torch.bucketize(magnitude, midpoints, out_int32=True, right=True)  # midpoints <= |x|
    code = below + ((upto > below) & (below % 2 == 1)).int()  # on a midpoint: up from an odd code
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


# --------------------------------------------------------------------------- scales

def e4m3_to_float(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values (or their uint8 bytes) -> float32, by table: works where fp8 casts don't."""
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    elif t.dtype != torch.uint8:
        raise ValueError(f"e4m3_to_float needs float8_e4m3fn or uint8, got {t.dtype}")
    return _on("E4M3_TABLE", t.device)[t.int()]


def float_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3fn (ties to even), saturating at +-448 (e4m3fn has no infinity)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The encode scale 448 * 6 / amax as float32 [1]; 1 where that is not a positive finite number
    (amax NaN, Inf, zero or subnormal), as compressed-tensors' ``generate_gparam`` falls back."""
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    scale = (E4M3_MAX * FP4_MAX) / amax.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))


_tensor_global_scale = global_scale  # quantize_weight's argument shadows the name


def _quantize_blocks(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, K] and its global scale -> (codes uint8 [R, K], block scales float8_e4m3fn [R, K/16])."""
    blocks = x.unflatten(-1, (x.shape[-1] // GROUP, GROUP))
    decoded = e4m3_to_float(float_to_e4m3(g * (blocks.abs().amax(dim=-1) / FP4_MAX)))
    decoded = decoded.masked_fill(decoded == 0, ZERO_SCALE)
    scale = float_to_e4m3(decoded)  # exact: every decoded value is an e4m3 number
    codes = round_to_e2m1(blocks / (decoded / g).unsqueeze(-1))
    return codes.flatten(-2), scale


def _decode(values: torch.Tensor, scale: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E2M1 values fp32 [R, K] * block scale / global scale, in fp32 (code * scale is exact), cast last."""
    blocks = values.unflatten(-1, (values.shape[-1] // GROUP, GROUP))
    blocks = blocks.mul_(e4m3_to_float(scale).unsqueeze(-1)).div_(g.float().to(values.device))
    return blocks.flatten(-2).to(dtype)


def _check_groups(k: int, what: str) -> None:
    if k % GROUP:
        raise ValueError(f"NVFP4 quantizes {what} in blocks of {GROUP} along the input dimension; "
                         f"{k} is not a multiple of {GROUP}")


# --------------------------------------------------------------------------- weights

@dataclass(frozen=True)
class PackedWeight:
    packed: torch.Tensor  # uint8 [N, K/2]
    scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    global_scale: torch.Tensor  # float32 [1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.packed, self.scale, self.global_scale, dtype)


def quantize_weight(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> PackedWeight:
    """Quantize a weight [N, K]. ``global_scale`` overrides the tensor's own 448 * 6 / amax (layers
    fused at run time share the smallest of theirs, so one decode scale serves all of them)."""
    if w.ndim != 2:
        raise ValueError(f"quantize_weight needs a 2-D weight, got shape {tuple(w.shape)}")
    _check_groups(w.shape[1], f"a weight of shape {tuple(w.shape)}")
    wf = w.float()
    g = _tensor_global_scale(wf.abs().amax()) if global_scale is None else global_scale.float().reshape(1)
    g = g.to(wf.device)
    codes, scale = _quantize_blocks(wf, g)
    return PackedWeight(pack_fp4(codes), scale, g)


def dequantize_weight(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W = E2M1(code) * float32(scale) / global_scale in fp32, cast to ``dtype`` last."""
    values = _on("_BYTE_PAIRS", packed.device)[packed.int()].flatten(-2)
    if values.shape[:-1] != scale.shape[:-1] or values.shape[-1] != scale.shape[-1] * GROUP:
        raise ValueError(f"packed {tuple(packed.shape)} and scale {tuple(scale.shape)} do not describe "
                         f"one NVFP4 tensor (scale needs one column per {GROUP // 2} packed bytes)")
    return _decode(values, scale, global_scale, dtype)


# --------------------------------------------------------------------------- activations (W4A4)

def quantize_activations(x: torch.Tensor, input_global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes uint8 [M, K/2], block scales float8_e4m3fn [M, K/16]) for an FP4 GEMM:
    per row and 16-group, scale e4m3(gi * amax / 6) from the data and the static global scale gi."""
    _check_groups(x.shape[-1], "activations")
    g = input_global_scale.float().reshape(1).to(x.device)
    codes, scale = _quantize_blocks(x.float(), g)
    return pack_fp4(codes), scale


def fake_quantize_activations(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] quantized to NVFP4 and decoded again (what the FP4 GEMM sees), in x.dtype."""
    _check_groups(x.shape[-1], "activations")
    g = input_global_scale.float().reshape(1).to(x.device)
    rows = x.reshape(-1, x.shape[-1]).float()
    codes, scale = _quantize_blocks(rows, g)
    values = _on("E2M1_VALUES", x.device)[codes.int()]
    return _decode(values, scale, g, x.dtype).reshape(x.shape)


# --------------------------------------------------------------------------- kernel layout

def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [R, C] in the 128x4 layout of cuBLAS / CUTLASS, flattened: zero-padded to R % 128
    == 0 and C % 4 == 0, each 128x4 tile stored as 512 bytes at (r % 32) * 16 + (r // 32 % 4) * 4 +
    c % 4, tiles row-block major."""
    rows, cols = scales.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = scales.new_zeros((padded_rows, padded_cols))
    padded[:rows, :cols] = scales
    tiles = padded.view(padded_rows // 128, 4, 32, padded_cols // 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)
