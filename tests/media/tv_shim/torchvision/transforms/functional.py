"""``torchvision.transforms.functional``: ``InterpolationMode`` and ``pil_to_tensor``."""

from __future__ import annotations

import enum

import numpy as np
import PIL.Image
import torch


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def pil_to_tensor(pic: PIL.Image.Image) -> torch.Tensor:
    array = np.array(pic, copy=True)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()
