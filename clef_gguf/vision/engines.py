"""The vision engines: how a loaded vision tower's arithmetic runs. Their names live in
``clef_gguf.core.limits.VisionEngine`` (what ``--vision-engine`` takes); this module is each one's
implementation, applied to the fp32 module ``load.build`` made.

``exact``  fp32 PyTorch: the reference's numerics (the module as built: oneDNN's fp32 Linear kernel and
           SDPA's fused attention, ``clef_gguf.vision.model``). The default.
``int8``   the transformer blocks' Linear layers (qkv, attention output, the two MLP layers: ~97% of the
           arithmetic at Clef-Flash's shape) in dynamic int8: weights int8 (symmetric, one scale per
           output row), each call's activations quantized to uint8 (one scale and zero point per call),
           int32 accumulation in PyTorch's fbgemm / oneDNN kernels. The patch embedding, positions,
           RoPE, attention's softmax, the norms and the merger stay fp32 (quantizing the patch
           embedding, whose inputs are raw pixels, loses too much). ~2x faster than ``exact`` on a
           2-thread AVX-512 VNNI CPU (1.19 s against 2.42 s at Clef-Flash's shape), its rows 4.1e-2
           from exact's there (random weights), max |dp| 4.5e-4 on the tiny test releases: not the
           reference's numbers, so opt-in (docs/media.md, "Vision engines: exact and int8").

On a CPU without VNNI the activations use 7 bits (``reduce_range``), as fbgemm needs there to keep
its 16-bit intermediate sums from saturating; with VNNI the products go straight into int32 and all 8
bits are used (half the error, the same speed).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
from torch import nn

from clef_gguf.core.errors import InvalidSetting
from clef_gguf.core.limits import VISION_ENGINES
from clef_gguf.vision.model import VisionModel

DEFAULT = "exact"
FIELD = "vision_engine"


def check(engine: str) -> str:
    if engine not in VISION_ENGINES:
        raise InvalidSetting(f"vision_engine must be one of {', '.join(VISION_ENGINES)}, got {engine!r}",
                             field=FIELD)
    return engine


@functools.cache
def has_vnni() -> bool:
    """Whether this CPU multiplies uint8 by int8 into int32 directly (AVX-512 VNNI), so that the int8
    engine may use 8-bit activations; False where it cannot tell (not Linux)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags.split()


class DynamicInt8Linear(nn.Module):
    """``nn.Linear`` as int8 weights packed for PyTorch's quantized engine, the activations quantized
    per call (``torch.ops.quantized.linear_dynamic``); float32 in, float32 out."""

    def __init__(self, linear: nn.Linear, *, per_channel: bool, reduce_range: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.reduce_range = reduce_range
        w = linear.weight.detach().float()
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        with warnings.catch_warnings():  # quantized tensors are deprecated upstream, still shipped (2.13)
            warnings.simplefilter("ignore")
            if per_channel:
                scales = (w.abs().amax(dim=1).clamp_min(1e-12) / 127.5).double()
                qweight = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long), 0,
                                                     torch.qint8)
            else:
                qweight = torch.quantize_per_tensor(w, float(w.abs().max().clamp_min(1e-12)) / 127.5, 0,
                                                    torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, reduce_range=self.reduce_range)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, reduce_range={self.reduce_range}"


def quantize_blocks(model: VisionModel, *, per_channel: bool = True, reduce_range: bool | None = None) -> VisionModel:
    """Every ``nn.Linear`` of ``model.blocks`` replaced by a ``DynamicInt8Linear`` (in place)."""
    if reduce_range is None:
        reduce_range = not has_vnni()
    if per_channel and torch.backends.quantized.engine == "qnnpack":
        per_channel = False  # QNNPACK (ARM) packs one weight scale per tensor
    for module in model.blocks.modules():
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, DynamicInt8Linear(child, per_channel=per_channel, reduce_range=reduce_range))
    return model


def apply(model: VisionModel, engine: str) -> VisionModel:
    """``model`` (fp32, as built) made ready to run under ``engine``."""
    check(engine)
    if engine == "exact":
        return model
    if model.patch_embed.proj.weight.dtype != torch.float32:
        raise InvalidSetting(f"the {engine} vision engine quantizes an fp32 tower, not "
                             f"{model.patch_embed.proj.weight.dtype}", field=FIELD)
    try:
        return quantize_blocks(model)
    except (RuntimeError, AttributeError) as exc:  # a torch build without quantized CPU kernels
        raise InvalidSetting(f"the {engine} vision engine needs PyTorch's quantized CPU kernels: {exc}",
                             field=FIELD) from None
