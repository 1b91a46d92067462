"""Where a fine-tune's files are: a directory written by ``clef-gguf convert adapter``.

It holds ``clef-gguf-adapter.json`` beside a LoRA GGUF for one base tower, the fine-tune's head and
the base's head config:

    {"format": "clef-gguf-adapter/1", "name": ..., "adapter": "adapter-f16.gguf",
     "head_weights": "joint_head.safetensors", "head_config": "joint_head_config.json",
     "base": {"name", "tower", "tower_sha256", "architecture", "n_embd", "n_layer", "n_vocab"},
     "lora": {"rank", "alpha", "targets", "outtype"},
     "source": {"checkpoint", "tool", "base_model", "train_config"},
     "files": {"adapter-f16.gguf": {"sha256": ..., "size": ...}, ...}}

``lora.alpha`` is what the GGUF carries: llama.cpp scales each pair by alpha / rank, or by 1 when
alpha is 0 (PEFT's per-module scales are then folded into ``lora_b``). Standard library only: the
runtime reads this without the converter's dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from clef_gguf.core.errors import CorruptModel, ModelNotFound
from clef_gguf.formats.files import checked_manifest

ADAPTER_MANIFEST = "clef-gguf-adapter.json"
ADAPTER_FORMAT = "clef-gguf-adapter/1"
ADAPTER_ROLES = ("adapter", "head_weights", "head_config")
# Keys of "base" and "lora" with the JSON types they must have (bool is refused where int is asked).
BASE_KEYS: dict[str, type | tuple[type, ...]] = {
    "name": str, "tower": str, "tower_sha256": str, "architecture": str,
    "n_embd": int, "n_layer": int, "n_vocab": int}
LORA_KEYS: dict[str, type | tuple[type, ...]] = {
    "rank": int, "alpha": (int, float), "targets": int, "outtype": str}


def adapter_file_name(outtype: str) -> str:
    return f"adapter-{outtype}.gguf"


def _typed(table: object, keys: dict[str, type | tuple[type, ...]]) -> bool:
    return isinstance(table, dict) and all(
        isinstance(table.get(key), kind) and not isinstance(table.get(key), bool)
        for key, kind in keys.items())


def read_adapter_manifest(directory: str | Path) -> dict:
    """The manifest of a fine-tune directory, checked: a missing directory, manifest or listed
    file is ModelNotFound, a malformed manifest (or one naming files outside the directory)
    CorruptModel; field "adapter" in both."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelNotFound(f"fine-tune directory not found: {directory}", field="adapter")
    path = directory / ADAPTER_MANIFEST
    if not path.is_file():
        raise ModelNotFound(f"{directory} has no {ADAPTER_MANIFEST}: not a fine-tune directory "
                            f"(make one with `clef-gguf convert adapter`)", field="adapter")

    def bad(why: str) -> CorruptModel:
        return CorruptModel(f"{path} {why}", field="adapter")

    manifest = checked_manifest(path, ADAPTER_FORMAT, ADAPTER_ROLES, "adapter")
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise bad('has no "files" table')
    if not isinstance(manifest.get("name"), str):
        raise bad("has a name that is not text")
    if not _typed(manifest.get("base"), BASE_KEYS):
        raise bad(f'has a "base" that is not {{{", ".join(BASE_KEYS)}}}')
    if not _typed(manifest.get("lora"), LORA_KEYS):
        raise bad(f'has a "lora" that is not {{{", ".join(LORA_KEYS)}}}')
    if not isinstance(manifest.get("source", {}), dict):
        raise bad('has a "source" that is not an object')
    unhashed = [manifest[role] for role in ADAPTER_ROLES if manifest[role] not in listed]
    if unhashed:
        raise bad(f"lists no sha256 for {', '.join(unhashed)}")
    for role in ADAPTER_ROLES:
        if not (directory / manifest[role]).is_file():
            raise ModelNotFound(f"{role} file not found: {directory / manifest[role]}", field="adapter")
    return manifest


@dataclass
class AdapterFiles:
    """A fine-tune directory's files and identity, from its checked manifest."""

    directory: Path
    name: str
    adapter: Path
    head_weights: Path
    head_config: Path
    base: dict
    lora: dict
    source: dict = field(default_factory=dict)
    # sha256 by file name, as the manifest recorded them at conversion.
    sha256: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_directory(cls, path: str | Path) -> AdapterFiles:
        directory = Path(path)
        manifest = read_adapter_manifest(directory)
        return cls(directory=directory, name=manifest["name"],
                   adapter=directory / manifest["adapter"],
                   head_weights=directory / manifest["head_weights"],
                   head_config=directory / manifest["head_config"],
                   base=dict(manifest["base"]), lora=dict(manifest["lora"]),
                   source=dict(manifest.get("source", {})),
                   sha256={name: entry["sha256"] for name, entry in manifest["files"].items()})
