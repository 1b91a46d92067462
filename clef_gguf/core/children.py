"""Child Python processes that run a module of the clef_gguf this process runs, from any directory.

``python -m clef_gguf.x`` puts the current directory first on the child's ``sys.path``. Run from a
clone's root after ``pip install .``, that finds the clone's ``clef_gguf/`` folder, which holds no
``heads/``, ``convert/`` or ``models/`` (pyproject's ``package-dir`` maps those in from the top-level
folders), instead of the installed package: the child dies on ``No module named
'clef_gguf.models'``. Every child process start goes through :func:`module_command`, which runs the
module through a two-line bootstrap that drops that entry first (``-c`` makes it ``''``; Python 3.11's
``-P``/``PYTHONSAFEPATH`` adds none, and then nothing is dropped). The child's environment is the
parent's: a ``PYTHONPATH`` the user set still applies.

Ray's workers are children too: Ray puts the driver's working directory first on every worker's
``sys.path`` (``ray._private.worker.connect``: ``py_driver_sys_path``), so a local Ray started from a
clone's root imports the clone's folder in each worker. :func:`start_ray` starts it from the folder
that holds this clef_gguf instead (paths the workers get are absolute already:
``LoadSettings.for_workers``).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from pathlib import Path
from typing import IO, Any

# sys.argv of the child: ["-c", module, *args] -> [module, *args], as `python -m module args` sets it.
_BOOT = ("import runpy, sys\n"
         "if not getattr(sys.flags, 'safe_path', False):\n"
         "    del sys.path[0]  # the current directory, which -c put first\n"
         "module = sys.argv[1]\n"
         "sys.argv[:] = [module, *sys.argv[2:]]\n"
         "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")


def module_command(module: str, *args: str) -> list[str]:
    """The argv that runs ``python -m module args`` with this interpreter, importing the installed
    clef_gguf whatever the child's current directory holds."""
    if not module.startswith("clef_gguf."):
        raise ValueError(f"not a clef_gguf module: {module!r}")
    return [sys.executable, "-c", _BOOT, module, *args]


def package_root() -> Path:
    """The folder that holds the clef_gguf this process runs (site-packages, or an editable install's clone)."""
    return Path(__file__).resolve().parents[2]


def start_ray(ray: Any, **kwargs: Any) -> None:
    """``ray.init(**kwargs)`` with :func:`package_root` as the working directory Ray hands its workers."""
    here = os.getcwd()
    os.chdir(package_root())
    try:
        ray.init(**kwargs)
    finally:
        os.chdir(here)


class LineReader:
    """A child's output, each line handed over as a reader thread gets it (``None`` at its end): a
    deadline waits on ``get``. select() on a buffered text pipe would miss the lines Python read ahead."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def get(self, timeout: float) -> str | None:
        """The next line, or None at the end; ``queue.Empty`` when none came within ``timeout`` seconds."""
        return self.lines.get(timeout=max(0.0, timeout))

    def join(self, timeout: float) -> bool:
        """Whether the reader saw the end within ``timeout`` seconds (then the stream may be closed)."""
        self.thread.join(timeout)
        return not self.thread.is_alive()
