"""``torchvision.transforms``: the interpolation enum and the two functional modules."""

from .functional import InterpolationMode
from . import functional, v2

__all__ = ["InterpolationMode", "functional", "v2"]
