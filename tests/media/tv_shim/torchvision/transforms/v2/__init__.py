"""``torchvision.transforms.v2``."""

from . import functional

__all__ = ["functional"]
