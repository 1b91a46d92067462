"""``torchvision.transforms.v2.functional``: the tensor kernels transformers' Qwen processors call (CPU)."""

from __future__ import annotations

import torch
from torch.nn.functional import interpolate
from torch.nn.functional import pad as torch_pad

from ..functional import InterpolationMode, pil_to_tensor

__all__ = ["InterpolationMode", "crop", "grayscale_to_rgb", "normalize", "pad", "resize", "to_dtype",
           "to_tensor", "pil_to_tensor"]


def _native_uint8(interpolation: InterpolationMode) -> bool:
    # torchvision's _do_native_uint8_resize_on_cpu
    if interpolation == InterpolationMode.BILINEAR:
        return "AVX2" in torch.backends.cpu.get_cpu_capability()
    return interpolation == InterpolationMode.BICUBIC


def resize(image: torch.Tensor, size: list[int], interpolation: InterpolationMode = InterpolationMode.BILINEAR,
           max_size: int | None = None, antialias: bool | None = True) -> torch.Tensor:
    """torchvision's ``resize_image`` for a CPU tensor and an explicit ``[height, width]``."""
    antialias = False if antialias is None else antialias
    align_corners: bool | None = None
    if interpolation in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC):
        align_corners = False
    else:
        antialias = False
    shape = image.shape
    num_channels, old_height, old_width = shape[-3:]
    new_height, new_width = int(size[0]), int(size[1])
    if (new_height, new_width) == (old_height, old_width):
        return image
    if image.numel() > 0:
        dtype = image.dtype
        acceptable = [torch.float32, torch.float64]
        if interpolation in (InterpolationMode.NEAREST, InterpolationMode.NEAREST_EXACT):
            acceptable.append(torch.uint8)
        elif image.device.type == "cpu" and _native_uint8(interpolation):
            acceptable.append(torch.uint8)
        image = image.reshape(-1, num_channels, old_height, old_width)
        need_cast = dtype not in acceptable
        if need_cast:
            image = image.to(dtype=torch.float32)
        image = interpolate(image, size=[new_height, new_width], mode=interpolation.value,
                            align_corners=align_corners, antialias=antialias)
        if need_cast:
            if interpolation == InterpolationMode.BICUBIC and dtype == torch.uint8:
                image = image.clamp_(min=0, max=255)
            if dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
                image = image.round_()
            image = image.to(dtype=dtype)
    return image.reshape(shape[:-3] + (num_channels, new_height, new_width))


def normalize(image: torch.Tensor, mean: object, std: object, inplace: bool = False) -> torch.Tensor:
    """torchvision's ``normalize_image``."""
    if not image.is_floating_point():
        raise TypeError(f"Input tensor should be a float tensor. Got {image.dtype}.")
    mean_t = torch.as_tensor(mean, dtype=image.dtype, device=image.device)
    std_t = torch.as_tensor(std, dtype=image.dtype, device=image.device)
    if mean_t.ndim == 1:
        mean_t = mean_t.view(-1, 1, 1)
    if std_t.ndim == 1:
        std_t = std_t.view(-1, 1, 1)
    image = image.sub_(mean_t) if inplace else image.sub(mean_t)
    return image.div_(std_t)


def grayscale_to_rgb(image: torch.Tensor) -> torch.Tensor:
    if image.shape[-3] >= 3:
        return image
    return image.repeat_interleave(3, dim=-3) if image.shape[-3] == 1 else image


def to_dtype(image: torch.Tensor, dtype: torch.dtype = torch.float32, scale: bool = False) -> torch.Tensor:
    if not scale or image.dtype == dtype:
        return image.to(dtype)
    if image.is_floating_point() and not torch.empty((), dtype=dtype).is_floating_point():
        return image.mul(255.0).round_().to(dtype)
    if not image.is_floating_point() and torch.empty((), dtype=dtype).is_floating_point():
        return image.to(dtype).div_(255.0)
    return image.to(dtype)


def pad(image: torch.Tensor, padding: list[int], fill: float = 0, padding_mode: str = "constant") -> torch.Tensor:
    if len(padding) == 2:
        left = right = padding[0]
        top = bottom = padding[1]
    else:
        left, top, right, bottom = padding
    return torch_pad(image, [left, right, top, bottom], mode=padding_mode, value=fill)


def crop(image: torch.Tensor, top: int, left: int, height: int, width: int) -> torch.Tensor:
    return image[..., top:top + height, left:left + width]


def to_tensor(pic: object) -> torch.Tensor:
    raise NotImplementedError("the shim does not implement to_tensor")
