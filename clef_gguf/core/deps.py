"""Optional dependencies: imported where they are used, and a missing one reported one way.

Every package that is not in ``pyproject.toml``'s ``dependencies`` (ray, pyarrow, mcp, transformers,
compressed-tensors, flash-linear-attention, matplotlib...) is installed by one of its extras
(:data:`EXTRAS`). Code that needs one calls :func:`need`, which imports it or raises
``MissingDependency`` (code ``missing_dependency``) with the message
``"{what}: pip install 'clef-gguf[{extra}]'"``: the same words wherever it is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

from clef_gguf.core.errors import MissingDependency

# pyproject.toml's extras that install optional packages (``test`` aside): tests/core/test_deps.py holds
# this list equal to pyproject's, and every extra a ``need`` call names one of them.
EXTRAS = ("parity", "nvfp4", "fla", "parquet", "ray", "mcp", "eval")


def install_hint(extra: str) -> str:
    """The command that installs ``extra``: ``pip install 'clef-gguf[ray]'``."""
    return f"pip install 'clef-gguf[{extra}]'"


def missing(what: str, extra: str, *, field: str | None = None) -> MissingDependency:
    """The error for a missing (or unusable) optional package: ``what`` says which and who needs it."""
    return MissingDependency(f"{what}: {install_hint(extra)}", field=field)


def need(module: str, extra: str, *, what: str | None = None, field: str | None = None) -> Any:
    """Import ``module`` (dotted, e.g. ``"pyarrow.parquet"``) and return it, or raise
    :func:`missing`'s error; ``what`` defaults to ``"{module} is not installed"``. Typed ``Any``:
    the module's user knows what it is."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing(what or f"{module} is not installed", extra, field=field) from None
