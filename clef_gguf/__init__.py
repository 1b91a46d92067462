"""clef-gguf: Cloudflare's Clef decision models on a GGUF language tower + a PyTorch joint head.

    from clef_gguf import Clef
    clef = Clef.load("path/to/model-dir")
    clef.decide({"state": "...", "questions": {"urgent": {"type": "noul"}}})
"""

import logging

from clef_gguf.core.errors import ClefError

# A library logs; the application decides where it goes (without this, llama.cpp's warnings would
# reach stderr through logging's last-resort handler).
logging.getLogger("clef_gguf").addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = ["Clef", "ClefError", "__version__"]


def __getattr__(name: str):
    # Lazy: `import clef_gguf.core.errors` (or the CLI's --help) should not load torch and llama.cpp.
    if name == "Clef":
        from clef_gguf.runtime.model import Clef

        return Clef
    raise AttributeError(f"module 'clef_gguf' has no attribute {name!r}")
