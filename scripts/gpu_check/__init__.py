"""The GPU check: every GPU target measured in one short run, into one JSON report (docs/gpu.md).

    bash scripts/gpu-check.sh BUNDLE [options]     # installs the offline bundle, then runs this package
    python scripts/gpu_check [options]             # the check with the clef_gguf this Python imports
    python scripts/gpu_check nvfp4-backend         # the nvfp4 backend's own check (``nvfp4_backend``)

One module per concern; each imports only the ones listed before it (tests/test_scripts.py holds the
package to it: no import cycle, and no parity bar but ``clef_gguf.core.limits``'):

- ``report``: the report file and the measurement lines a row prints;
- ``common``: the rows every GPU run needs (preflight, parity, latency, throughput, pick, kernels) and
  the models they share;
- ``nvfp4``: the nvfp4 row, and the backend's CPU half (a process of its own);
- ``rows``: the rows in priority order, with their planned cost;
- ``run``: the plan and the deadline: each row in a process group of its own, the report as it goes;
- ``nvfp4_backend``: the nvfp4 backend's own check (kernels, fp32 GPU vs CPU, latency), apart from the rows;
- ``__main__``: the commands.

This module holds only how the package starts itself in a child process (:func:`command`).
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def command(*args: str) -> list[str]:
    """The argv that runs this package's ``__main__`` with ``args`` in a child: by path, so the child's
    ``sys.path`` starts with ``scripts/`` and never with its current directory (a clone's ``clef_gguf/``
    folder there would shadow the installed package)."""
    return [sys.executable, str(PACKAGE), *args]
