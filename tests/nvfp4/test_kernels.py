"""NVFP4Linear: the dequantizing fallback against F.linear on the dequantized weight (and QDQ'd
activations for W4A4), any leading shape; the device test; the log strings; and the native W4A4
wiring (TN operands, swizzled scales, alpha) against an emulated ``torch._scaled_mm`` on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clef_gguf.tower.nvfp4 import format as fmt
from clef_gguf.tower.nvfp4 import kernels
from clef_gguf.tower.nvfp4.kernels import NVFP4Linear, kernel_name, native_fp4

SHAPES = [(64,), (5, 64), (2, 3, 64), (2, 1, 4, 64)]


def layer(in_features=64, out_features=48, *, activations: bool, bias: bool = False, seed: int = 0) -> NVFP4Linear:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * torch.rand(out_features, 1, generator=gen)
    gi = fmt.global_scale(torch.tensor(3.0)) if activations else None
    b = torch.randn(out_features, generator=gen) if bias else None
    return NVFP4Linear.from_packed(fmt.quantize_weight(w), input_global_scale=gi, bias=b)


def inputs(shape, dtype=torch.float32, seed=1) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def dequantized(lin: NVFP4Linear, dtype) -> torch.Tensor:
    return fmt.dequantize_weight(lin.weight_packed, lin.weight_scale, lin.weight_global_scale, dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_only_fallback_is_linear_on_the_dequantized_weight(shape, dtype, bias):
    lin = layer(activations=False, bias=bias)
    x = inputs(shape, dtype)
    y = lin(x)
    b = None if lin.bias is None else lin.bias.to(dtype)
    ref = F.linear(x.reshape(-1, 64), dequantized(lin, dtype), b).reshape(*shape[:-1], 48)
    assert y.shape == (*shape[:-1], 48) and y.dtype == dtype
    assert torch.equal(y, ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a4_fallback_fake_quantizes_the_activations(shape, dtype):
    lin = layer(activations=True, bias=True)
    x = inputs(shape, dtype)
    qdq = fmt.fake_quantize_activations(x, lin.input_global_scale)
    ref = F.linear(qdq, dequantized(lin, dtype), lin.bias.to(dtype))
    y = lin(x)
    assert y.dtype == dtype and torch.equal(y, ref)
    weights_only = F.linear(x, dequantized(lin, dtype), lin.bias.to(dtype))
    assert not torch.equal(y, weights_only)  # W4A4 numbers, not silently W4A16's


def test_buffers_state_dict_and_dtype_casts():
    lin = layer(activations=True, bias=True)
    state = lin.state_dict()
    assert {k: (v.dtype, tuple(v.shape)) for k, v in state.items() if k != "bias"} == {
        "weight_packed": (torch.uint8, (48, 32)), "weight_scale": (torch.float8_e4m3fn, (48, 4)),
        "weight_global_scale": (torch.float32, (1,)), "input_global_scale": (torch.float32, (1,))}
    fresh = NVFP4Linear(64, 48, activations=True, bias=True)
    fresh.load_state_dict(state)
    x = inputs((3, 64))
    assert torch.equal(fresh(x), lin(x))
    assert set(NVFP4Linear(64, 48, activations=False).state_dict()) == {
        "weight_packed", "weight_scale", "weight_global_scale"}
    # Module.to(dtype) must not round the fp32 global scales or touch the fp8 scales
    g = lin.weight_global_scale.clone()
    lin.to(torch.bfloat16)
    assert lin.weight_scale.dtype == torch.float8_e4m3fn and lin.weight_global_scale.dtype == torch.float32
    assert torch.equal(lin.weight_global_scale, g) and lin.bias.dtype == torch.bfloat16
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4Linear(40, 8, activations=False)


def test_native_fp4_only_on_blackwell(monkeypatch):
    assert not native_fp4("cpu") and not native_fp4(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for major, native in [(8, False), (9, False), (10, True), (11, True), (12, True), (13, False)]:
        monkeypatch.setattr(kernels, "_capability_major", lambda device, major=major: major)
        assert native_fp4("cuda:0") is native, major
        assert not native_fp4("cpu")
    monkeypatch.delattr(torch, "float4_e2m1fn_x2")
    assert not native_fp4("cuda:0")


def test_kernel_names(monkeypatch):
    assert kernel_name("cpu", True) == "dequantizing fallback, layer by layer (W4A4 activations fake-quantized)"
    assert kernel_name("cpu", False) == "dequantizing fallback, layer by layer (weights only)"
    assert kernel_name("cpu", False, dense=True) == "dense weights dequantized once at load (weights only)"
    monkeypatch.setattr(kernels, "native_fp4", lambda device: True)
    assert kernel_name("cuda", True) == "native FP4 GEMM (torch._scaled_mm, W4A4)"
    assert kernel_name("cuda", False) == "dequantizing fallback, layer by layer (weights only)"


# --------------------------------------------------------------------------- native path, emulated

def ref_unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of the cuBLAS 128x4 layout, index by index."""
    tiles_c = -(-cols // 4)
    out = torch.empty(rows, cols, dtype=flat.dtype)
    for r in range(rows):
        for c in range(cols):
            out[r, c] = flat[((r // 128) * tiles_c + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4]
    return out


def emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype=None):
    """What cuBLASLt's NVFP4 GEMM computes, with the layout checks it makes: sum over k of
    E2M1(a) * scale_a * E2M1(b) * scale_b, no global scales."""
    assert a.dtype == b.dtype == torch.float4_e2m1fn_x2
    assert scale_a.dtype == scale_b.dtype == torch.float8_e4m3fn
    assert a.stride(1) == 1 and b.stride(0) == 1, "TN: row-major activations, column-major weight"
    assert scale_a.is_contiguous() and scale_b.is_contiguous()
    m, n, k = a.shape[0], b.shape[1], a.shape[1] * 2
    one = torch.ones(1)
    a_vals = fmt.dequantize_weight(a.view(torch.uint8), ref_unswizzle(scale_a.view(torch.uint8), m, k // 16)
                                   .view(torch.float8_e4m3fn), one)
    b_vals = fmt.dequantize_weight(b.t().view(torch.uint8), ref_unswizzle(scale_b.view(torch.uint8), n, k // 16)
                                   .view(torch.float8_e4m3fn), one)
    return (a_vals.double() @ b_vals.double().t()).to(out_dtype)


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64)])
def test_native_path_wiring_with_emulated_scaled_mm(monkeypatch, shape):
    lin = layer(64, 48, activations=True, bias=True, seed=3)
    x = inputs(shape, seed=4)
    fallback = lin(x)
    monkeypatch.setattr(kernels, "native_fp4", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    native = lin(x)
    assert native.shape == fallback.shape
    # same codes and scales; only where the global scales are applied differs (in the sum, or per element)
    torch.testing.assert_close(native, fallback, rtol=1e-5, atol=1e-5)
    # a weights-only layer never takes the native path
    a16 = NVFP4Linear.from_packed(fmt.PackedWeight(lin.weight_packed, lin.weight_scale, lin.weight_global_scale))
    assert torch.equal(a16(x), F.linear(x, dequantized(lin, torch.float32)))


def test_native_path_skips_shapes_cublas_refuses(monkeypatch):
    lin = layer(48, 24, activations=True)  # K % 32 != 0 and N % 16 != 0
    monkeypatch.setattr(kernels, "native_fp4", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: pytest.fail("native GEMM on unsupported shapes"))
    x = inputs((3, 48))
    assert torch.equal(lin(x), F.linear(fmt.fake_quantize_activations(x, lin.input_global_scale),
                                        dequantized(lin, torch.float32)))
