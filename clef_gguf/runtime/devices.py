"""Where the joint head runs (``head_device``): beside the tower on its GPU, or on the CPU.

The head is a quarter of a decision when it runs on the CPU behind a GPU tower (27 ms of 110 ms on an
H200, measured before the head could move); beside the tower, a decision's hidden states and lexical rows cross to
the device once (``heads/joint.py`` moves both, whole, to its parameters' device) and its logits come
back once. ``cuda`` where torch has no CUDA is refused by name, never a silent CPU run.
"""

from __future__ import annotations

import logging

import torch

from clef_gguf.core.errors import InvalidSetting

log = logging.getLogger(__name__)
CPU = torch.device("cpu")


def check_head_device(asked: str) -> None:
    """Refuse an explicit CUDA device this torch cannot give, before any model file is loaded."""
    if asked in ("auto", "cpu"):
        return
    if not torch.cuda.is_available():
        built = "a CPU-only build" if not torch.backends.cuda.is_built() else "no CUDA device visible"
        raise InvalidSetting(f"head_device {asked!r}: torch {torch.__version__} has {built}; use cpu or auto",
                             field="head_device")
    index = int(asked.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise InvalidSetting(f"head_device {asked!r}: torch sees {torch.cuda.device_count()} CUDA device(s)",
                             field="head_device")


def head_device(asked: str, tower_cuda: int | None) -> torch.device:
    """The device for ``asked`` (checked by :func:`check_head_device`): ``auto`` is the tower's CUDA
    device when torch sees CUDA, else the CPU."""
    check_head_device(asked)
    if asked == "cpu" or (asked == "auto" and (tower_cuda is None or not torch.cuda.is_available())):
        return CPU
    index = int(asked.partition(":")[2]) if ":" in asked else (tower_cuda or 0)
    return torch.device("cuda", index)


def exact_fp32(device: torch.device) -> None:
    """TF32 off for an fp32 head on CUDA: TF32 rounds a matmul's inputs to 10 bits of mantissa, ~1e-3 of
    a logit, where the head's parity bar is 1e-6 (process-wide: torch has no per-module switch)."""
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        log.info("TF32 matmuls turned off: the fp32 head's parity with the reference")
        torch.backends.cuda.matmul.allow_tf32 = False
