"""Optional dependencies of the bulk engines (pyarrow, ray): imported when used, or a clear error
naming the extra that installs them."""

from __future__ import annotations

import importlib
from typing import Any

from clef_gguf.core.errors import MissingDependency


def need(module: str, extra: str) -> Any:  # the module, typed by its user
    """Import an optional dependency or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependency(f"{module} is not installed: pip install 'clef-gguf[{extra}]'",
                                field=None) from None
