"""Native clef-arch GGUFs (head inside): downloaded like a tower, then split once into a model directory.

llama-cpp-python 0.3.36 loads a qwen35 tower, not the clef architecture, so a native file is split on
download into ``$HF_HOME/clef-gguf/split/<repo>@<commit>/<quant>/`` (qwen35 tower, head files,
tokenizer.json rebuilt from the GGUF's vocabulary), once per cached blob.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
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
        with FileLock(str(lock), timeout=SPLIT_LOCK_TIMEOUT_S):
            if not split_is_current(out, blob):
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
        raise ModelLoadError(f"{lock} stayed locked for {SPLIT_LOCK_TIMEOUT_S} s (another process "
                             "working on the same file?)", field="model") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot {verb} {label} into {out}: {exc}", field="model") from None


def _split_once(native: Path, out: Path, name: str, label: str) -> ModelFiles:
    def split(dst: Path) -> None:
        from clef_gguf.convert.split import split_native  # torch + gguf: only to split

        split_native(native, dst, name=name)

    return converted_once(native.resolve(), out, split, f"the native GGUF {label}", verb="split")
