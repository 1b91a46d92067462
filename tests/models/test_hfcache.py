"""The Hugging Face cache's verification stamps: concurrent processes keep each other's."""

from __future__ import annotations

from pathlib import Path

_STAMPER = """
import sys
from pathlib import Path
from clef_gguf.models import hfcache
for blob in sys.argv[1:]:
    hfcache._write_stamp(Path(blob), "ab" * 32, checked=True)
"""


def test_concurrent_processes_keep_each_others_stamps(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    from clef_gguf.models import hfcache

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    blobs = []
    for i in range(4 * 25):
        blob = tmp_path / "blobs" / f"b{i}"
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(b"x" * i)
        blobs.append(str(blob))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    procs = [subprocess.Popen([sys.executable, "-c", _STAMPER, *blobs[k::4]], env=env)
             for k in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    stamped = {b for b in blobs if hfcache.stamp(Path(b)) is not None}
    assert stamped == set(blobs)  # without the lock, read-modify-write races dropped entries
