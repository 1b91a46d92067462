"""The Qwen3.5 vision tower: image and video patches in, language-model embeddings out.

The math of transformers' ``Qwen3_5VisionModel`` (the module the reference runs), written for inference:

    x   = W_patch · patch + b                       one Conv3d step over a (C, T, P, P) patch is a linear map
    x  += bilinear(pos_table, h × w)                the learned position grid resized with align_corners
    x  += Attn(LN1(x)),  Attn with 2-D RoPE         patches attend only within their frame (an image, or
                                                    one temporal patch, i.e. two frames, of a video)
    x  += MLP(LN2(x)),   MLP = fc2 · gelu_tanh · fc1
    out = fc2 · gelu_erf · fc1 · concat₂ₓ₂(LN(x))   the merger: every m × m patch block becomes one token

Kernels (the same arithmetic in fp32, summed in another order): every Linear runs through oneDNN's fp32
kernel where PyTorch has it (``Linear``: ~2.4x MKL's sgemm at the blocks' sizes on a 2-core AVX-512
CPU), and attention through SDPA's fused CPU kernel on [1, heads, N, head_dim], as transformers calls it
(the 3-D call took SDPA's unfused math path, ~3x slower).

The processor emits patches in merge-block order (for each m × m block of the frame, its patches in raster
order), so tokens come out in the order they replace the ``<|image_pad|>``/``<|video_pad|>`` ids. No deepstack.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# LayerNorm eps of every norm in the tower (transformers hard-codes it; the config does not carry it).
NORM_EPS = 1e-6

# config ``hidden_act`` -> the block MLP's activation (transformers' ACT2FN names).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    num_position_embeddings: int
    out_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: C · T · P · P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merged_dim(self) -> int:
        return self.hidden_size * self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:
        """Side of the square learned position grid."""
        return int(round(self.num_position_embeddings ** 0.5))


def block_order(grid: torch.Tensor, m: int) -> torch.Tensor:
    """[h, w, ...] in raster order -> [h·w, ...] in merge-block order (the processor's patch order)."""
    h, w = grid.shape[:2]
    rest = grid.shape[2:]
    blocks = grid.reshape(h // m, m, w // m, m, *rest).transpose(1, 2)
    return blocks.reshape(h * w, *rest)


@functools.cache
def onednn_linear() -> bool:
    """Whether this PyTorch has oneDNN's fp32 linear kernel and it agrees with ``F.linear`` (checked once,
    on a small case): a build without it, or a future one that changes it, falls back to ``F.linear``."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=gen) for shape in ((5, 24), (7, 24), (7,)))
        with torch.inference_mode():
            return torch.backends.mkldnn.is_available() and \
                bool(torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), rtol=1e-4, atol=1e-5))
    except (AttributeError, RuntimeError):
        return False


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters) whose fp32 CPU inference runs through oneDNN's kernel (``onednn_linear``):
    fp32 throughout (~5e-7 relative from a float64 product, as MKL's sgemm), another summation order.
    Anything else (another dtype, autograd, another device, no oneDNN) is ``F.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu" \
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)) \
                and onednn_linear():
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def rope_inv_freq(c: VisionConfig) -> torch.Tensor:
    """Frequencies of the axial RoPE: head_dim / 4 of them, shared by the row and the column halves."""
    quarter = torch.arange(0, c.head_dim // 2, 2, dtype=torch.float32) / (c.head_dim // 2)
    return 1.0 / c.rope_theta ** quarter


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]; cos, sin [N, head_dim] in float32. Rotated in float32, as the reference does."""
    xf = x.float()
    out = xf * cos[:, None] + rotate_half(xf) * sin[:, None]
    return out.to(x.dtype)


class PatchEmbed(nn.Module):
    """Conv3d with stride = kernel over (C, T, P, P) patches, as the linear map it is."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.proj = Linear(c.patch_dim, c.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class Attention(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.qkv = Linear(c.hidden_size, 3 * c.hidden_size)
        self.proj = Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)  # each [N, heads, head_dim]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Full (non-causal) attention inside each frame (a temporal patch), none across frames or images;
        # 4-D [1, heads, N, head_dim] as transformers calls it: SDPA's fused CPU kernel (3-D takes its math path).
        out = [F.scaled_dot_product_attention(qi.transpose(0, 1)[None], ki.transpose(0, 1)[None],
                                              vi.transpose(0, 1)[None])[0]
               for qi, ki, vi in zip(q.split(frames), k.split(frames), v.split(frames))]
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = Linear(c.hidden_size, c.intermediate_size)
        self.linear_fc2 = Linear(c.intermediate_size, c.hidden_size)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=NORM_EPS)
        self.attn = Attention(c)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=NORM_EPS)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """LayerNorm per patch, then each m × m block's patches side by side -> fc1 -> exact GELU -> fc2."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = c.merged_dim
        self.norm = nn.LayerNorm(c.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = Linear(c.merged_dim, c.merged_dim)
        self.linear_fc2 = Linear(c.merged_dim, c.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    """``forward(pixel_values [patches, C·T·P·P], grid_thw [n, 3]) -> [tokens, out_hidden_size]``.

    Parameter names are the release's (``model.visual.`` stripped), except ``patch_embed.proj.weight``,
    which is the Conv3d kernel flattened to [hidden, C·T·P·P].
    """

    inv_freq: torch.Tensor

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.merger = Merger(c)
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)

    def positions(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Learned position embeddings, bilinearly resized (align_corners) to each frame: [patches, hidden]."""
        side, m = self.config.grid_side, self.config.spatial_merge_size
        table = self.pos_embed.weight.float().reshape(side, side, -1).permute(2, 0, 1)[None]
        out = []
        for t, h, w in grid_thw.tolist():
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
            out.append(block_order(grid, m).repeat(t, 1))
        return torch.cat(out)

    def rope(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D RoPE angles: the first half of each head turns with the patch row, the second with its column."""
        m = self.config.spatial_merge_size
        out = []
        for t, h, w in grid_thw.tolist():
            rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            out.append(block_order(torch.stack([rows, cols], dim=-1), m).repeat(t, 1))
        angles = torch.cat(out).float()[..., None] * self.inv_freq  # [N, 2, head_dim / 4]
        half = angles.flatten(1)  # row angles then column angles: [N, head_dim / 2]
        full = torch.cat([half, half], dim=-1)
        return full.cos(), full.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        dtype = self.patch_embed.proj.weight.dtype
        x = self.patch_embed(pixel_values.to(dtype))
        x = x + self.positions(grid_thw).to(dtype)
        cos, sin = self.rope(grid_thw)
        frames = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merger(x)
