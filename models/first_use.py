"""A pulled model converted on first use, once: the lock two processes share, the staged directory that
is complete or absent, and whether a conversion is still that of the cached blob. Native clef GGUFs
(``native.py``, split) and NVFP4 checkpoints (``nvfp4_materialize.py``, re-encoded) both go through it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

from clef_gguf.core.errors import ClefError, ConversionError, ModelLoadError
from clef_gguf.formats.files import MANIFEST, ROLES, ModelFiles, from_directory, read_manifest

# A conversion copies or re-encodes the whole tower (GBs); a second process wanting the same one waits for it.
CONVERSION_LOCK_TIMEOUT_S = 3600


def conversion_is_current(out: Path, blob: Path) -> bool:
    """True if ``out`` is a complete conversion of this very ``blob`` (a file or a snapshot directory),
    unchanged since."""
    try:
        manifest = read_manifest(out)
        made_ns = (out / MANIFEST).stat().st_mtime_ns
        # The blob's path names its content (the HF cache names blobs by hash, snapshots by commit); a
        # blob rewritten after the conversion (a re-download) is newer than the manifest written at its end.
        return ((manifest.get("source") or {}).get("path") == str(blob)
                and blob.stat().st_mtime_ns <= made_ns
                and all((out / manifest[role]).is_file() for role in ROLES))
    except (OSError, ClefError):
        return False


def converted_once(blob: Path, out: Path, convert: Callable[[Path], object], label: str, *,
                   verb: str = "convert") -> ModelFiles:
    """``out``, a model directory that ``convert(out)`` makes from ``blob`` (the manifest's source path),
    made once: under a lock, so two processes resolving the same model do not both convert GBs, and
    staged beside ``out`` by the converter (``files.staged_directory``), so ``out`` is complete or absent;
    made again when ``blob`` changed."""
    lock = out.parent / f".{out.name}.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock), timeout=CONVERSION_LOCK_TIMEOUT_S):
            if not conversion_is_current(out, blob):
                shutil.rmtree(out, ignore_errors=True)  # made from another blob, or incomplete
                # A killed conversion leaves its stage; holding the lock, nobody else is using one.
                for stage in out.parent.glob(f".{out.name}.*"):
                    if stage != lock:
                        shutil.rmtree(stage, ignore_errors=True)
                try:
                    convert(out)
                except ConversionError as exc:
                    raise ConversionError(f"cannot {verb} {label}: {exc.message}", field="model") from None
            return from_directory(out)
    except Timeout:
        raise ModelLoadError(f"{lock} stayed locked for {CONVERSION_LOCK_TIMEOUT_S} s (another process "
                             "working on the same file?)", field="model") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot {verb} {label} into {out}: {exc}", field="model") from None
