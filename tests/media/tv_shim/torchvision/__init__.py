"""A test-only stand-in for torchvision 0.28's CPU code paths that transformers' Qwen3-VL processors call.

PyPI's torchvision for torch 2.13 is a CUDA build that does not import beside the CPU torch of the test
environment, and transformers' fast image processor and every video processor need it. This package
reimplements just the functions they call with torch (resizing) and Pillow (decoding), following
torchvision's own sources (``transforms/v2/functional/_geometry.py: resize_image``, ``_misc.py:
normalize_image``, ``io/image.py: decode_image``), so the reference runs the math the real one runs on
CPU. Tests put this directory on ``PYTHONPATH`` of a child process only: nothing else sees it.
"""

from . import io, transforms

__version__ = "0.28.0"
__all__ = ["io", "transforms"]
