"""``python tests/server/gated_serve.py GATE_DIR SERVE_ARGS...``: the real ``clef-gguf serve``
(argument parsing, signals, drain, exit code) whose model holds every forward pass until the file
``GATE_DIR/release`` exists. Before waiting, pass number N writes ``GATE_DIR/entered-N``.

A child process cannot share a ``threading.Event`` with the test; files can, and they let a test
send SIGTERM exactly while a request is inside the model, whatever the machine's speed.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from clef_gguf.runtime import flags
from clef_gguf.server import app

HOLD_LIMIT_S = 120.0  # a test that never releases must not keep the process alive forever


class FileGated:
    def __init__(self, clef, gate: Path) -> None:
        self.clef, self.gate = clef, gate
        self.info, self.provenance = clef.info, getattr(clef, "provenance", None)
        self._passes = 0
        self._lock = threading.Lock()

    def prepare(self, *args, **kwargs):
        return self.clef.prepare(*args, **kwargs)

    def run(self, prepared):
        with self._lock:
            self._passes += 1
            n = self._passes
        (self.gate / f"entered-{n}").touch()
        end = time.monotonic() + HOLD_LIMIT_S
        while not (self.gate / "release").exists() and time.monotonic() < end:
            time.sleep(0.01)
        return self.clef.run(prepared)

    def close(self) -> None:
        self.clef.close()


def main() -> int:
    gate = Path(sys.argv[1])
    real_load = flags.load_model
    # ``serve`` looks the loader up when it starts, so replacing it here is enough.
    flags.load_model = lambda args: FileGated(real_load(args), gate)
    return app.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
