"""clef_gguf.tower.nvfp4.format against two references: a plain per-element transcription of the format
(design §1.3-§1.5, §3) written here, and compressed-tensors 0.20 itself as an oracle (its pack/unpack,
quantize/dequantize, fake-quant forward and global-scale code).

Where the two orders of rounding differ, it is by design and bounded: we decode ``code * scale / g``
in fp32 (code * scale is exact, so one rounding); compressed-tensors decodes ``code * (scale / g)``
(two). Codes, block scales and global scales are bit-identical.
"""

from __future__ import annotations

import math

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize, quantize
from compressed_tensors.quantization.quant_scheme import NVFP4
from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp, generate_gparam
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

from clef_gguf.tower.nvfp4 import format as fmt

WEIGHT_ARGS, ACT_ARGS = NVFP4["weights"], NVFP4["input_activations"]
MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
FP32_ULP = 2.0 ** -23


# --------------------------------------------------------------------------- plain references

def ref_e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * MAGNITUDES[code & 7]


def ref_e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0x0F, byte & 0x07
    if e == 15 and m == 7:
        return math.nan
    return sign * (m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def ref_round(x: float) -> int:
    """Nearest magnitude by brute force, ties to the even code; sign bit from x."""
    a = min(abs(x), 6.0)
    best = min(range(8), key=lambda i: (abs(a - MAGNITUDES[i]), i % 2))
    return best | (8 if math.copysign(1.0, x) < 0 else 0)


def ref_dequantize(packed: torch.Tensor, scale_bytes: torch.Tensor, g: float) -> torch.Tensor:
    """W[n, k] = E2M1(nibble) * e4m3(scale byte) / g, element by element in float64."""
    rows, half = packed.shape
    out = torch.empty(rows, half * 2, dtype=torch.float64)
    for n in range(rows):
        for k in range(half * 2):
            byte = int(packed[n, k // 2])
            code = byte & 0x0F if k % 2 == 0 else byte >> 4
            out[n, k] = ref_e2m1(code) * ref_e4m3(int(scale_bytes[n, k // 16])) / g
    return out.float()  # double rounding f64 -> f32 is exact for one division (53 >= 2 * 24 + 2)


def ct_weight(w: torch.Tensor, g: torch.Tensor | None = None):
    """compressed-tensors' NVFP4 weight quantization of an fp32 weight: (packed, scale fp8, g)."""
    g = generate_gparam(w.amin(), w.amax()) if g is None else g
    blocks = w.unflatten(-1, (w.shape[-1] // 16, 16))
    scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), WEIGHT_ARGS, global_scale=g)
    codes = quantize(w, scale, zp, WEIGHT_ARGS, global_scale=g)
    return pack_fp4_to_uint8(codes), scale.to(torch.float8_e4m3fn), g


def ct_activations(x: torch.Tensor, gi: torch.Tensor):
    """compressed-tensors' dynamic tensor_group/16 fp4 activation QDQ: (fake-quantized, fp4 values, scale)."""
    scale, zp = compute_dynamic_scales_and_zp(x, ACT_ARGS, torch.nn.Module(), global_scale=gi)
    return (fake_quantize(x, scale, zp, ACT_ARGS, global_scale=gi),
            quantize(x, scale, zp, ACT_ARGS, global_scale=gi), scale.to(torch.float8_e4m3fn))


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def within_ulp(ours: torch.Tensor, theirs: torch.Tensor, ulp: float = FP32_ULP) -> bool:
    return bool(((ours.float() - theirs.float()).abs() <= theirs.float().abs() * ulp).all())


def random_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16-valued fp32 (what a release holds), rows of very different size, one all-zero block."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen).pow(3) * 4
    w[1, 16:32] = 0
    return w.bfloat16().float()


# --------------------------------------------------------------------------- tables

def test_e2m1_values():
    assert fmt.E2M1_VALUES.dtype == torch.float32
    assert fmt.E2M1_VALUES.tolist() == [ref_e2m1(c) for c in range(16)]
    assert torch.signbit(fmt.E2M1_VALUES[8]) and fmt.E2M1_VALUES[8] == 0


def test_e4m3_to_float_all_bytes():
    every = torch.arange(256, dtype=torch.uint8)
    ours = fmt.e4m3_to_float(every)
    assert torch.equal(ours.view(torch.int32), fmt.e4m3_to_float(every.view(torch.float8_e4m3fn)).view(torch.int32))
    ref = torch.tensor([ref_e4m3(b) for b in range(256)], dtype=torch.float32)
    assert torch.equal(ours.isnan(), ref.isnan()) and ours.isnan().sum() == 2
    assert torch.equal(ours.nan_to_num(), ref.nan_to_num())
    torch_decoded = every.view(torch.float8_e4m3fn).float()
    assert torch.equal(ours.nan_to_num(), torch_decoded.nan_to_num())
    assert torch.equal(ours.signbit(), torch_decoded.signbit())
    assert ours[0x7E] == fmt.E4M3_MAX and ours[0x01] == 2.0 ** -9 and ours[0x38] == 1.0


def test_e4m3_to_float_rejects_other_dtypes():
    with pytest.raises(ValueError, match="float8_e4m3fn or uint8"):
        fmt.e4m3_to_float(torch.ones(3))


def test_float_to_e4m3_rounds_to_even_and_saturates():
    x = torch.tensor([1.0625, 1.1875, 500.0, -1e6, 2.0 ** -10, 3 * 2.0 ** -11, 0.0])
    assert fmt.e4m3_to_float(fmt.float_to_e4m3(x)).tolist() == [1.0, 1.25, 448.0, -448.0, 0.0, 2.0 ** -9, 0.0]
    assert fmt.float_to_e4m3(x).dtype == torch.float8_e4m3fn
    assert torch.isnan(fmt.e4m3_to_float(fmt.float_to_e4m3(torch.tensor([math.nan])))).all()


# --------------------------------------------------------------------------- E2M1 rounding and packing

@pytest.mark.parametrize("value, code", [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # ties to even (§1.3)
    (0.2499, 0), (0.2501, 1), (6.0, 7), (6.5, 7), (1e30, 7), (math.inf, 7), (-1e30, 15),
    (0.0, 0), (-0.0, 8), (-0.1, 8), (-5.01, 15), (-2.5, 12), (-0.75, 10),
])
def test_round_to_e2m1_edges(value, code):
    assert fmt.round_to_e2m1(torch.tensor([value])).tolist() == [code]
    assert ref_round(value) == code


def test_round_to_e2m1_random_against_references():
    gen = torch.Generator().manual_seed(1)
    grid = torch.tensor(MAGNITUDES)
    midpoints = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([torch.randn(4000, generator=gen) * 3, grid, -grid[1:], midpoints, -midpoints,
                   torch.empty(500).uniform_(-8, 8, generator=gen)])
    codes = fmt.round_to_e2m1(x)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [ref_round(v) for v in x.tolist()]
    # compressed-tensors' own rounding (clamp, then nearest E2M1 value) on the same numbers
    assert torch.equal(fmt.E2M1_VALUES[codes.long()], cast_to_fp4(x.clamp(-6, 6)))


def test_pack_unpack_round_trip_and_nibble_order():
    assert fmt.pack_fp4(torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)).tolist() == [[0x21, 0x8F]]
    codes = torch.randint(0, 16, (2, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    packed = fmt.pack_fp4(codes)
    assert packed.shape == (2, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(fmt.unpack_fp4(packed), codes)
    with pytest.raises(ValueError):
        fmt.pack_fp4(torch.zeros(3, 5, dtype=torch.uint8))


def test_pack_unpack_against_compressed_tensors():
    codes = torch.randint(0, 16, (24, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    values = fmt.E2M1_VALUES[codes.long()]  # code 8 is -0.0, which compressed-tensors packs as 8 too
    assert torch.equal(pack_fp4_to_uint8(values), fmt.pack_fp4(codes))
    unpacked = unpack_fp4_from_uint8(fmt.pack_fp4(codes), 24, 96, dtype=torch.float32)
    assert torch.equal(unpacked, fmt.E2M1_VALUES[fmt.unpack_fp4(fmt.pack_fp4(codes)).long()])


# --------------------------------------------------------------------------- global scale

def test_global_scale():
    assert fmt.global_scale(torch.tensor(2.0)).tolist() == [1344.0]
    for bad in (0.0, math.nan, math.inf, 1e-40, -0.0):
        out = fmt.global_scale(torch.tensor(bad))
        assert out.dtype == torch.float32 and out.shape == (1,) and out.tolist() == [1.0], bad
    amax = torch.tensor([1e-30, 3e-3, 0.7, 1.0, 13.25, 4e4, 0.0, math.nan])
    for a in amax:
        assert torch.equal(fmt.global_scale(a), generate_gparam(-a.reshape(1), a.reshape(1))), a


# --------------------------------------------------------------------------- weights

def test_dequantize_matches_plain_reference():
    gen = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (6, 24), dtype=torch.uint8, generator=gen)
    scale_bytes = torch.randint(0, 0x7F, (6, 3), dtype=torch.uint8, generator=gen)  # no NaN
    scale_bytes[0, 0] |= 0x80  # a negative scale decodes too
    g = torch.tensor([1234.5678])
    ref = ref_dequantize(packed, scale_bytes, float(g))
    ours = fmt.dequantize_weight(packed, scale_bytes.view(torch.float8_e4m3fn), g)
    assert ours.dtype == torch.float32 and torch.equal(ours, ref)
    assert torch.equal(fmt.dequantize_weight(packed, scale_bytes.view(torch.float8_e4m3fn), g, torch.bfloat16),
                       ref.bfloat16())


def test_dequantize_against_compressed_tensors():
    w = random_weight(64, 128, seed=5)
    packed, scale, g = ct_weight(w)
    theirs = dequantize(unpack_fp4_from_uint8(packed, 64, 128, dtype=torch.float32), scale.float(),
                        args=WEIGHT_ARGS, global_scale=g, dtype=torch.float32)
    ours = fmt.dequantize_weight(packed, scale, g)
    assert within_ulp(ours, theirs)
    assert ours.abs().max() > 0


@pytest.mark.parametrize("seed", [6, 7, 8])
def test_quantize_weight_bit_identical_to_compressed_tensors(seed):
    w = random_weight(96, 256, seed)
    ours = fmt.quantize_weight(w)
    packed, scale, g = ct_weight(w)
    assert ours.packed.dtype == torch.uint8 and ours.packed.shape == (96, 128)
    assert ours.scale.dtype == torch.float8_e4m3fn and ours.scale.shape == (96, 16)
    assert ours.global_scale.dtype == torch.float32 and ours.global_scale.shape == (1,)
    assert torch.equal(ours.global_scale, g)
    assert torch.equal(bytes_of(ours.scale), bytes_of(scale))
    assert torch.equal(ours.packed, packed)
    assert fmt.e4m3_to_float(ours.scale)[1, 1] == fmt.ZERO_SCALE  # the all-zero block
    # bf16 input quantizes like its fp32 value
    assert torch.equal(fmt.quantize_weight(w.bfloat16()).packed, packed)


def test_quantize_weight_with_a_shared_global_scale():
    w = random_weight(32, 64, seed=9)
    shared = fmt.global_scale(w.abs().amax() * 3)  # a fused neighbour with 3x the amax
    ours = fmt.quantize_weight(w, global_scale=shared)
    packed, scale, _ = ct_weight(w, shared)
    assert torch.equal(ours.global_scale, shared)
    assert torch.equal(ours.packed, packed) and torch.equal(bytes_of(ours.scale), bytes_of(scale))
    rel = (ours.dequantize() - w).norm() / w.norm()
    assert rel < 0.15


def test_quantize_weight_edge_values():
    one = torch.ones(1)
    w = torch.zeros(4, 32)
    w[0, :16] = torch.tensor([6 * 448.0, -6 * 448.0] + [0.0] * 14)  # the largest magnitude at g = 1
    w[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75,
                              -2.5, -3.5, -5.0, -6.0])  # amax 6 at g = 1: scale 1, ties land on the grid
    w[2, :] = -0.0
    q = fmt.quantize_weight(w, global_scale=one)
    codes = fmt.unpack_fp4(q.packed)
    scales = fmt.e4m3_to_float(q.scale)
    assert scales[0, 0] == 448.0 and codes[0, :2].tolist() == [7, 15]
    assert scales[1, 0] == 1.0 and codes[1, :16].tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 15]
    assert (scales[2:] == fmt.ZERO_SCALE).all() and (scales[0, 1] == fmt.ZERO_SCALE)
    assert (codes[2] == 8).all() and (codes[3] == 0).all()  # the sign of -0.0 is kept
    d = q.dequantize()
    assert d[0, :2].tolist() == [2688.0, -2688.0]
    assert torch.equal(d[1, :16], fmt.E2M1_VALUES[codes[1, :16].long()])
    assert (d[2] == 0).all() and torch.signbit(d[2]).all() and not torch.signbit(d[3]).any()
    # compressed-tensors agrees on every code except exact -0.0, which it stores as +0 (torch.sign(-0.0) is 0)
    packed, scale, _ = ct_weight(w, one)
    assert torch.equal(packed[:2], q.packed[:2]) and torch.equal(bytes_of(scale), bytes_of(q.scale))
    assert (fmt.unpack_fp4(packed[2]) == 0).all()


def test_quantize_weight_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 16"):
        fmt.quantize_weight(torch.ones(4, 40))
    with pytest.raises(ValueError, match="2-D"):
        fmt.quantize_weight(torch.ones(4, 4, 16))
    with pytest.raises(ValueError, match="do not describe"):
        fmt.dequantize_weight(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.float8_e4m3fn),
                              torch.ones(1))


# --------------------------------------------------------------------------- activations (W4A4)

def activations(shape, seed, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 5
    x[..., 0, :16] = 0  # an all-zero block
    x[..., 1, 3] = 40.0  # an outlier whose block scale saturates at 448 under gi below
    return x.to(dtype)


def test_fake_quantize_activations_against_compressed_tensors():
    x = activations((3, 4, 64), seed=10)
    gi = fmt.global_scale(torch.tensor(8.0))  # calibrated on a smaller amax than the outlier's
    ours = fmt.fake_quantize_activations(x, gi)
    theirs, fp4_values, scale = ct_activations(x, gi)
    assert ours.shape == x.shape and ours.dtype == torch.float32
    assert within_ulp(ours, theirs)
    codes, scales = fmt.quantize_activations(x.reshape(12, 64), gi)
    assert torch.equal(codes, pack_fp4_to_uint8(fp4_values.reshape(12, 64)))
    assert torch.equal(bytes_of(scales), bytes_of(scale.reshape(12, 4)))
    assert fmt.e4m3_to_float(scales).max() == 448.0
    # bf16 activations: the math runs in fp32 and rounds to bf16 once
    xb = x.bfloat16()
    ours_b = fmt.fake_quantize_activations(xb, gi)
    assert ours_b.dtype == torch.bfloat16
    assert within_ulp(ours_b, ct_activations(xb.float(), gi)[0].bfloat16(), ulp=2.0 ** -8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_activations_decodes_to_the_fake_quantized_values(dtype):
    x = activations((33, 96), seed=11, dtype=dtype)
    gi = fmt.global_scale(x.float().abs().amax())
    codes, scales = fmt.quantize_activations(x, gi)
    assert codes.shape == (33, 48) and codes.dtype == torch.uint8
    assert scales.shape == (33, 6) and scales.dtype == torch.float8_e4m3fn
    assert torch.equal(fmt.dequantize_weight(codes, scales, gi, dtype), fmt.fake_quantize_activations(x, gi))
    with pytest.raises(ValueError, match="multiple of 16"):
        fmt.quantize_activations(torch.ones(2, 24), gi)


# --------------------------------------------------------------------------- 128x4 swizzle

def ref_swizzle(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS block-scale layout, index by index: 128x4 tiles row-block major, each tile 512 bytes
    with (r, c) at (r % 32) * 16 + (r // 32) * 4 + c; padding zero."""
    rows, cols = scales.shape
    tiles_c = -(-cols // 4)
    out = torch.zeros(-(-rows // 128) * tiles_c * 512, dtype=scales.dtype)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * tiles_c + c // 4
            out[tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4] = scales[r, c]
    return out


@pytest.mark.parametrize("rows, cols", [(128, 4), (130, 6), (300, 9), (7, 1)])
def test_swizzle_against_index_reference(rows, cols):
    gen = torch.Generator().manual_seed(rows * cols)
    scales = torch.randint(1, 0x7F, (rows, cols), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    ours = fmt.swizzle_block_scales(scales)
    assert ours.dtype == torch.float8_e4m3fn and ours.ndim == 1 and ours.is_contiguous()
    assert ours.numel() == -(-rows // 128) * 128 * -(-cols // 4) * 4
    assert torch.equal(bytes_of(ours), ref_swizzle(scales.view(torch.uint8)))
