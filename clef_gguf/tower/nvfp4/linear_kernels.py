"""Which kernels run Qwen3.5's linear attention (gated delta rule) and its causal conv in transformers.

transformers 5.23 binds each of the four to a fast package when that imports at the moment its
``modeling_qwen3_5`` is imported (``use_kernel_func_from_hub_with_fallback``): flash-linear-attention's
Triton kernels (``fla``, the ``clef-gguf[fla]`` extra: pure Python + Triton, so its wheel travels) and
causal-conv1d's CUDA ones; otherwise its reference PyTorch code, which on a GPU is most of an NVFP4
decision (gpu.md: 324 ms for a 0.8B shape). This module reads what was bound, for one log line and the
tower's ``details()``; it chooses nothing itself: installing the package is the choice.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

from clef_gguf.core.deps import install_hint

# transformers' name of each function -> the package that replaces it, as pip spells it
PACKAGES = {"torch_chunk_gated_delta_rule": "flash-linear-attention",
            "torch_recurrent_gated_delta_rule": "flash-linear-attention",
            "causal_conv1d_fn": "causal-conv1d", "causal_conv1d_update": "causal-conv1d"}
REFERENCE = "reference PyTorch"


def _bound(fn: Any) -> tuple[bool, str] | None:
    """(replaced?, by which module) from the wrapper's closure; None where it is not transformers'."""
    while fn is not None:
        try:
            found = inspect.getclosurevars(fn).nonlocals
        except TypeError:
            found = {}
        if "is_new_implementation" in found:
            impl = found.get("implementation")
            return bool(found["is_new_implementation"]), getattr(impl, "__module__", "?")
        fn = getattr(fn, "__wrapped__", None)
    return None


def bound(modeling: ModuleType) -> dict[str, str]:
    """Each function -> the module whose kernel runs it, or ``REFERENCE``."""
    out = {}
    for name in PACKAGES:
        got = _bound(getattr(modeling, name, None))
        out[name] = "unknown" if got is None else (got[1] if got[0] else REFERENCE)
    return out


def describe(kernels: dict[str, str]) -> str:
    """One line: what runs, and what to install where the reference code runs."""
    slow = sorted({PACKAGES[n] for n, k in kernels.items() if k == REFERENCE})
    fast = sorted({k.split(".")[0] for k in kernels.values() if k not in (REFERENCE, "unknown")})
    said = f"linear attention kernels: {', '.join(fast) or 'none'} fast"
    if slow:
        said += f"; {REFERENCE} for {', '.join(slow)} (not installed: slow on a GPU; {install_hint('fla')})"
    return said
