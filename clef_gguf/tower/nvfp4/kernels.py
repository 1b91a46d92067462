"""Which GEMM multiplies by an NVFP4 weight, and the Linear layer that holds one.

Blackwell (compute capability 10.x, 11.x, 12.x) has FP4 tensor cores: a W4A4 layer quantizes its
activations to NVFP4 and runs one ``torch._scaled_mm`` on codes and swizzled block scales. Every
other device (Hopper has no FP4 MMA, CPUs none either) runs ``F.linear`` on the dequantized weight:
dequantized once at load when every layer's dense copy fits half the device's free memory
(:meth:`NVFP4Linear.materialize`, the same bits as dequantizing per call), else at each call, layer by
layer, so that only one dense weight exists at a time. A W4A4 layer first fake-quantizes its
activations, so the numbers stay those of the FP4 GEMM and not silently those of W4A16.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from clef_gguf.tower.nvfp4.format import (GROUP, PackedWeight, dequantize_weight, fake_quantize_activations,
                                    quantize_activations, swizzle_block_scales)

# Compute-capability majors with FP4 MMA: sm_100/103 (10), sm_110 (11), sm_120/121 (12).
FP4_MAJORS = frozenset({10, 11, 12})
NATIVE = "native FP4 GEMM (torch._scaled_mm, W4A4)"
FALLBACK = {True: "dequantizing fallback, layer by layer (W4A4 activations fake-quantized)",
            False: "dequantizing fallback, layer by layer (weights only)"}
DEQUANTIZED = {True: "dense weights dequantized once at load (W4A4 activations fake-quantized)",
               False: "dense weights dequantized once at load (weights only)"}
# Buffers whose dtype is the format's: Module.to(dtype) may move them but never cast them.
FIXED_DTYPE_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")


@functools.lru_cache(maxsize=None)
def _capability_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def native_fp4(device: torch.device | str) -> bool:
    """True on a Blackwell CUDA device with a torch that has FP4 tensors and ``_scaled_mm``."""
    device = torch.device(device)
    if device.type != "cuda" or not (hasattr(torch, "float4_e2m1fn_x2") and hasattr(torch, "_scaled_mm")):
        return False
    if not torch.cuda.is_available():
        return False
    return _capability_major(device) in FP4_MAJORS


def kernel_name(device: torch.device | str, activations: bool, dense: bool = False) -> str:
    """What NVFP4Linear runs on ``device``, in words (for one log line); ``dense``: the weights were
    dequantized once at load."""
    if activations and native_fp4(device):
        return NATIVE
    return (DEQUANTIZED if dense else FALLBACK)[bool(activations)]


def native_shapes(in_features: int, out_features: int) -> bool:
    """cuBLASLt's FP4 GEMM wants K/2 and N in multiples of 16 bytes / rows (K % 32, N % 16)."""
    return in_features % 32 == 0 and out_features % 16 == 0


def fp4_gemm(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
             weight_global_scale: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T on FP4 tensor cores, in x.dtype.

    The GEMM sums code_x * s_x * code_w * s_w; both global scales divide, so the output is that sum
    times alpha = 1 / (gi * gw) (``_scaled_mm`` has no slot for per-tensor scales next to block
    scales). Operands in the TN layout cuBLASLt needs: activations row-major [M, K/2], the weight's
    bytes viewed as FP4 pairs and transposed to a column-major [K/2, N]; block scales in the 128x4
    swizzle, contiguous.
    """
    codes, scales = quantize_activations(x, input_global_scale)
    out = torch._scaled_mm(codes.view(torch.float4_e2m1fn_x2),
                           weight_packed.view(torch.float4_e2m1fn_x2).t(),
                           swizzle_block_scales(scales), swizzle_block_scales(weight_scale),
                           out_dtype=x.dtype)
    alpha = 1.0 / (input_global_scale.float() * weight_global_scale.float())
    return (out.float() * alpha.to(out.device)).to(x.dtype)


class NVFP4Linear(torch.nn.Module):
    """y = x W^T (+ bias) with W stored as compressed-tensors NVFP4 buffers; ``activations`` makes it
    W4A4 (activations quantized with the static ``input_global_scale``), else W4A16."""

    # Buffers (registered in __init__), typed here: Module.__getattr__ says only "Tensor or Module".
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor
    input_global_scale: torch.Tensor  # W4A4 layers only

    def __init__(self, in_features: int, out_features: int, *, activations: bool, bias: bool = False) -> None:
        super().__init__()
        if in_features % GROUP:
            raise ValueError(f"NVFP4Linear needs in_features to be a multiple of {GROUP}, got {in_features}")
        self.in_features, self.out_features, self.activations = in_features, out_features, bool(activations)
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale",
                             torch.zeros(out_features, in_features // GROUP, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32))
        if self.activations:
            self.register_buffer("input_global_scale", torch.ones(1, dtype=torch.float32))
        self.bias = torch.nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_packed(cls, weight: PackedWeight, input_global_scale: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> NVFP4Linear:
        """A layer around an existing quantized weight (W4A4 when ``input_global_scale`` is given)."""
        out_features, half = weight.packed.shape
        layer = cls(half * 2, out_features, activations=input_global_scale is not None, bias=bias is not None)
        layer.weight_packed = weight.packed
        layer.weight_scale = weight.scale
        layer.weight_global_scale = weight.global_scale.float().reshape(1)
        if input_global_scale is not None:
            layer.input_global_scale = input_global_scale.float().reshape(1).to(weight.packed.device)
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> NVFP4Linear:
        # Module.to(dtype) casts every floating tensor, fp8 scales and fp32 global scales included;
        # those keep their dtype and only follow the device.
        fixed = {name: tensor for name in FIXED_DTYPE_BUFFERS if (tensor := self._buffers.get(name)) is not None}
        for name in fixed:
            del self._buffers[name]
        try:
            super()._apply(fn, recurse)
        finally:
            for name, tensor in fixed.items():
                moved = fn(tensor)
                self._buffers[name] = moved if moved.dtype == tensor.dtype else tensor.to(moved.device)
        return self

    def native(self, device: torch.device) -> bool:
        """Whether this layer runs the FP4 GEMM on ``device`` (then a dense copy is never made)."""
        return self.activations and native_fp4(device) and native_shapes(self.in_features, self.out_features)

    def dense_bytes(self, dtype: torch.dtype) -> int:
        return 0 if self.native(self.weight_packed.device) else \
            self.in_features * self.out_features * torch.empty(0, dtype=dtype).element_size()

    def materialize(self, dtype: torch.dtype) -> None:
        """Keep the dequantized weight (``dtype``, on the layer's device): the tensor each call would
        make, made once."""
        if not self.native(self.weight_packed.device):
            dense = dequantize_weight(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype=dtype)
            self.register_buffer("dense", dense, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.activations and native_fp4(x.device) and native_shapes(self.in_features, self.out_features):
            y = fp4_gemm(rows, self.weight_packed, self.weight_scale, self.weight_global_scale,
                         self.input_global_scale)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        else:
            if self.activations:
                rows = fake_quantize_activations(rows, self.input_global_scale)
            dense = self._buffers.get("dense")
            if dense is not None and dense.dtype == x.dtype and dense.device == x.device:
                weight = dense
            else:
                weight = dequantize_weight(self.weight_packed.to(x.device), self.weight_scale.to(x.device),
                                           self.weight_global_scale.to(x.device), dtype=x.dtype)
            bias = None if self.bias is None else self.bias.to(device=x.device, dtype=x.dtype)
            y = F.linear(rows, weight, bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        scheme = "W4A4" if self.activations else "W4A16"
        return f"in_features={self.in_features}, out_features={self.out_features}, {scheme}, " \
               f"bias={self.bias is not None}"
