"""``torchvision.io``: image decoding to a ``[C, H, W]`` uint8 tensor (libpng/libjpeg in the real one)."""

from __future__ import annotations

import enum
import io as _io

import numpy as np
import PIL.Image
import PIL.ImageOps
import torch


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def decode_image(source: object, mode: ImageReadMode = ImageReadMode.UNCHANGED,
                 apply_exif_orientation: bool = False) -> torch.Tensor:
    if isinstance(source, torch.Tensor):
        image = PIL.Image.open(_io.BytesIO(source.numpy().tobytes()))
    else:
        image = PIL.Image.open(str(source))
    if apply_exif_orientation:
        image = PIL.ImageOps.exif_transpose(image)
    if mode != ImageReadMode.RGB:
        raise NotImplementedError("the shim decodes ImageReadMode.RGB only")
    # libpng's RGB mode strips alpha (png_set_strip_alpha) and expands gray/palette, as convert("RGB").
    array = np.asarray(image.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def read_video(*args: object, **kwargs: object) -> object:
    raise NotImplementedError("the shim has no video decoder")
