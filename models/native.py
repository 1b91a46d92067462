"""Native clef-arch GGUFs (head inside): downloaded like a tower, then split once into a model directory.

llama-cpp-python 0.3.36 loads a qwen35 tower, not the clef architecture, so a native file is split on
download into ``$HF_HOME/clef-gguf/split/<repo>@<commit>/<quant>/`` (qwen35 tower, head files,
tokenizer.json rebuilt from the GGUF's vocabulary), once per cached blob.
"""

from __future__ import annotations

from pathlib import Path

from clef_gguf.formats.files import ModelFiles
from clef_gguf.models.catalog import Source
from clef_gguf.models.download import commit_of, fetch
from clef_gguf.models.first_use import converted_once
from clef_gguf.models.hfcache import split_dir


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


def _split_once(native: Path, out: Path, name: str, label: str) -> ModelFiles:
    def split(dst: Path) -> None:
        from clef_gguf.convert.split import split_native  # torch + gguf: only to split

        split_native(native, dst, name=name)

    return converted_once(native.resolve(), out, split, f"the native GGUF {label}", verb="split")
