"""Native clef-arch GGUFs (head inside): downloaded like a tower, then split once into a model directory.

llama-cpp-python 0.3.36 loads a qwen35 tower, not the clef architecture, so a native file is split on
download into ``$HF_HOME/clef-gguf/split/<repo>@<commit>/<quant>/`` (qwen35 tower, head files,
tokenizer.json rebuilt from the GGUF's vocabulary), once per cached blob.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from filelock import FileLock, Timeout

from clef_gguf.core.errors import ClefError, ConversionError, ModelLoadError
from clef_gguf.formats.files import MANIFEST, ROLES, ModelFiles, from_directory, read_manifest
from clef_gguf.models.catalog import Source
from clef_gguf.models.download import commit_of, fetch
from clef_gguf.models.hfcache import split_dir

# A split copies the whole tower (GBs); a second process wanting the same split waits for it.
SPLIT_LOCK_TIMEOUT_S = 3600


def materialize_native(src: Source, quant: str, *, name: str, local_only: bool, progress: bool,
                       check_main: bool = False, update: bool = False) -> ModelFiles:
    """A native clef-arch GGUF (head inside) as a model directory llama-cpp-python 0.3.36 loads.

    The download is split once into ``$HF_HOME/clef-gguf/split/<repo>@<commit>/<quant>/`` (qwen35
    tower, head files, tokenizer.json rebuilt from the GGUF's vocabulary); later resolves reuse it
    while it was made from the same cached blob, and split again if the blob changed."""
    native, _ = fetch(src, quant, name=name, local_only=local_only, progress=progress,
                      check_main=check_main, update=update)
    commit = commit_of(native) or src.revision or "main"
    out = split_dir(src.repo, commit, quant)
    found = _split_once(native, out, name, f"{src.repo} / {native.name}")
    found.revision = f"{src.repo}@{commit} (native GGUF, split by clef-gguf)"
    return found


def split_is_current(out: Path, blob: Path) -> bool:
    """True if ``out`` is a complete split of this very blob, unchanged since."""
    try:
        manifest = read_manifest(out)
        made_ns = (out / MANIFEST).stat().st_mtime_ns
        # The blob's path names its content (the HF cache names blobs by hash); a blob rewritten
        # after the split (a re-download) is newer than the manifest written at the split's end.
        return ((manifest.get("source") or {}).get("path") == str(blob)
                and blob.stat().st_mtime_ns <= made_ns
                and all((out / manifest[role]).is_file() for role in ROLES))
    except (OSError, ClefError):
        return False


def _split_once(native: Path, out: Path, name: str, label: str) -> ModelFiles:
    # Under a lock: two processes resolving the same model must not both copy a 6 GB tower. The
    # split stages beside ``out`` and renames it into place, so ``out`` is complete or absent.
    blob = native.resolve()
    lock = out.parent / f".{out.name}.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock), timeout=SPLIT_LOCK_TIMEOUT_S):
            if not split_is_current(out, blob):
                shutil.rmtree(out, ignore_errors=True)  # made from another blob, or incomplete
                # A killed split leaves its stage; holding the lock, nobody else is using one.
                for stage in out.parent.glob(f".{out.name}.split-*"):
                    shutil.rmtree(stage, ignore_errors=True)
                from clef_gguf.convert.split import split_native  # torch + gguf: only to split

                try:
                    split_native(native, out, name=name)
                except ConversionError as exc:
                    raise ConversionError(f"cannot split the native GGUF {label}: {exc.message}",
                                          field="model") from None
            return from_directory(out)
    except Timeout:
        raise ModelLoadError(f"{lock} stayed locked for {SPLIT_LOCK_TIMEOUT_S} s (another process "
                             "splitting the same file?)", field="model") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot split {label} into {out}: {exc}", field="model") from None
