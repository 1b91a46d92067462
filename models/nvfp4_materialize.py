"""NVFP4 GGUFs by name (``clef-flash:nvfp4a16-gguf``): no one publishes one, so the checkpoint is pulled
(``checkpoint``) and re-encoded on first use into ``$HF_HOME/clef-gguf/nvfp4-gguf/<repo>@<commit>/<quant>/``
(``convert.nvfp4_to_gguf``: the same codes and scales as llama.cpp NVFP4 tensors), once per snapshot, under a
lock and atomically (``first_use.converted_once``); later resolves reuse it."""

from __future__ import annotations

from pathlib import Path

from clef_gguf.formats.files import ModelFiles
from clef_gguf.models.catalog import Source
from clef_gguf.models.hfcache import clef_home
from clef_gguf.models.first_use import converted_once


def nvfp4_gguf_dir(repo: str, commit: str, quant: str) -> Path:
    return clef_home() / "nvfp4-gguf" / f"{repo.replace('/', '--')}@{commit}" / quant


def materialize_nvfp4_gguf(src: Source, checkpoint: ModelFiles, quant: str, *, name: str) -> ModelFiles:
    """The pulled ``checkpoint`` (its snapshot, head and tokenizer) as an NVFP4 GGUF model directory."""
    snapshot = checkpoint.tower.parent  # the snapshot's config.json: one directory per commit
    commit = snapshot.name
    out = nvfp4_gguf_dir(src.repo, commit, quant)

    def encode(dst: Path) -> None:
        from clef_gguf.convert.nvfp4_to_gguf import convert_checkpoint  # torch + gguf: only to re-encode

        convert_checkpoint(snapshot, dst, name=name, head_weights=checkpoint.head_weights,
                           head_config=checkpoint.head_config, tokenizer=checkpoint.tokenizer)

    found = converted_once(snapshot.resolve(), out, encode, f"the NVFP4 checkpoint {src.repo}@{commit}",
                           verb="re-encode")
    found.name = name
    found.revision = f"{checkpoint.revision} (re-encoded as NVFP4 GGUF by clef-gguf)"
    return found
