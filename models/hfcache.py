"""The Hugging Face cache as clef-gguf sees it: environment read at call time, and hash verification.

huggingface_hub reads ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_ENDPOINT`` once, at
import; these helpers read them whenever they are called, so a test (or a long-lived server) that
changes them is obeyed.

Verification: a file is checked against the catalog's sha256 where it knows one, else against the
Hub's LFS sha256, which is the cache blob's name. A mismatch deletes the snapshot link and the blob
(the next pull downloads it afresh) and raises ``CorruptModel``. Hashing a 6 GB tower takes seconds,
so a checked blob is stamped (path, size, mtime_ns -> sha256) in ``$HF_HOME/clef-gguf/verified.json``
and re-hashed only when it changes. The pins of first pulls live beside the stamps (``pins``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from clef_gguf.core.errors import CorruptModel
from clef_gguf.formats.files import sha256_file

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline() -> bool:
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))


def hf_home() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(os.path.expandvars(os.path.expanduser(os.environ.get("HF_HOME") or str(default))))


def cache_dir() -> Path:
    """The HF hub cache, as huggingface_hub would compute it now."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return Path(os.path.expandvars(os.path.expanduser(explicit))) if explicit else hf_home() / "hub"


def endpoint() -> str | None:
    return (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None


def token() -> str | None:
    return os.environ.get("HF_TOKEN") or None  # None: huggingface_hub falls back to the saved login


def repo_dir(repo: str) -> Path:
    return cache_dir() / ("models--" + repo.replace("/", "--"))


def clef_home() -> Path:
    """clef-gguf's own state beside the HF cache: verification stamps, pins, split models, vision parts."""
    return hf_home() / "clef-gguf"


def split_dir(repo: str, commit: str, quant: str) -> Path:
    """Where a native clef-arch GGUF of ``repo`` at ``commit`` is split into a model directory."""
    return clef_home() / "split" / f"{repo.replace('/', '--')}@{commit}" / quant


def vision_dir(repo: str, commit: str) -> Path:
    """Where the vision part of the release ``repo`` at ``commit`` is written by a pull."""
    return clef_home() / "vision" / f"{repo.replace('/', '--')}@{commit}"


def _stamps_path() -> Path:
    return clef_home() / "verified.json"


def _read_stamps() -> dict[str, Any]:
    try:
        stamps: dict[str, Any] = json.loads(_stamps_path().read_text())
        return stamps
    except (OSError, ValueError):
        return {}


def _write_stamp(blob: Path, sha: str | None, checked: bool = False) -> None:
    """Record (or with ``sha=None`` forget) a blob's hash.

    Read-modify-write under a file lock: concurrent ``pull`` / ``serve`` processes stamping other
    blobs must not drop each other's entries. The replace is atomic, so readers need no lock."""
    path = _stamps_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=60):
            stamps = _read_stamps()
            if sha is None:
                if stamps.pop(str(blob), None) is None:
                    return
            else:
                st = blob.stat()
                stamps[str(blob)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha,
                                     "checked": checked}
            replace_json(path, stamps)
    except (OSError, Timeout):  # a read-only HF_HOME or a stuck lock: verify again next time
        pass


def replace_json(path: Path, data: dict[str, Any]) -> None:
    # Write beside and rename: a reader sees the old file or the new one, never half of one.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def stamp(blob: Path) -> dict[str, Any] | None:
    """The stamp of an unchanged blob: {"sha256", "checked" (matched a reference hash), ...}, else None."""
    entry = _read_stamps().get(str(blob))
    try:
        st = blob.stat()
    except OSError:
        return None
    if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return entry
    return None


def verify(path: Path, expected: str | None, label: str) -> str:
    """sha256 of a cached file, checked against ``expected`` or the Hub's LFS sha256 (the blob name)."""
    blob = path.resolve()
    want = expected or (blob.name if SHA256_RE.match(blob.name) else None)
    known = stamp(blob)
    actual = known["sha256"] if known else sha256_file(blob)
    if want and actual != want:
        for p in {path, blob}:  # the snapshot link and its blob: the next pull downloads it afresh
            p.unlink(missing_ok=True)
        _drop_stamp(blob)
        raise CorruptModel(f"sha256 mismatch for {label}: expected {want}, got {actual}. The file was "
                           f"removed from the cache ({path}); run the pull again.", field="model")
    if not known or (want and not known.get("checked")):
        _write_stamp(blob, actual, checked=want is not None)
    return actual


def record_verified(path: Path, sha: str) -> None:
    """Stamp a file whose sha256 was computed as it was written: the next ``verify`` reads no byte of it."""
    _write_stamp(path.resolve(), sha, checked=True)


def _drop_stamp(blob: Path) -> None:
    _write_stamp(blob, None)
