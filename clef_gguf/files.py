"""Where a model's four files are: a converted directory (with its manifest) or explicit paths.

A converted directory holds ``clef-gguf.json`` (written by ``clef-gguf convert``):

    {"format": "clef-gguf/1", "name": ..., "outtype": ...,
     "tower": "tower-f32.gguf", "head_weights": "joint_head.safetensors",
     "head_config": "joint_head_config.json", "tokenizer": "tokenizer.json",
     "files": {"tower-f32.gguf": {"sha256": ..., "size": ...}, ...}}
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from clef_gguf.errors import CorruptModel, ModelNotFound

MANIFEST = "clef-gguf.json"
MANIFEST_FORMAT = "clef-gguf/1"
HEAD_WEIGHTS = "joint_head.safetensors"
HEAD_CONFIG = "joint_head_config.json"
TOKENIZER = "tokenizer.json"
ROLES = ("tower", "head_weights", "head_config", "tokenizer")


@dataclass
class ModelFiles:
    tower: Path
    head_weights: Path
    head_config: Path
    tokenizer: Path
    name: str = "clef"
    revision: str | None = None
    # sha256 by file name, where a manifest or a catalog already knows it.
    sha256: dict[str, str] = field(default_factory=dict)

    def paths(self) -> dict[str, Path]:
        return {role: getattr(self, role) for role in ROLES}

    def check_exist(self) -> None:
        for role, path in self.paths().items():
            if not path.is_file():
                raise ModelNotFound(f"{role} file not found: {path}", field=role)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, name: str, outtype: str, roles: dict[str, str],
                   extra: dict | None = None) -> Path:
    """Hash every file named in ``roles`` (role -> file name in ``directory``) and write the manifest."""
    files = {}
    for file_name in roles.values():
        path = directory / file_name
        files[file_name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    manifest = {"format": MANIFEST_FORMAT, "name": name, "outtype": outtype, **roles,
                "files": files, **(extra or {})}
    out = directory / MANIFEST
    out.write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CorruptModel(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CorruptModel(f"{path} is not a {MANIFEST_FORMAT} manifest")
    missing = [role for role in ROLES if not isinstance(manifest.get(role), str)]
    if missing:
        raise CorruptModel(f"{path} does not name the {', '.join(missing)} file(s)")
    return manifest


def from_directory(directory: Path) -> ModelFiles:
    """Files of a converted model directory; without a manifest, the one ``*.gguf`` in it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelNotFound(f"model directory not found: {directory}", field="model")
    if (directory / MANIFEST).is_file():
        manifest = read_manifest(directory)
        files = ModelFiles(**{role: directory / manifest[role] for role in ROLES},
                           name=str(manifest.get("name", directory.name)),
                           revision=manifest.get("revision"),
                           sha256={k: v["sha256"] for k, v in manifest.get("files", {}).items()
                                   if isinstance(v, dict) and "sha256" in v})
    else:
        ggufs = sorted(directory.glob("*.gguf"))
        if len(ggufs) != 1:
            found = ", ".join(p.name for p in ggufs) or "none"
            raise ModelNotFound(f"{directory} has no {MANIFEST} and not exactly one .gguf file "
                                f"(found: {found}); pass --gguf explicitly", field="model")
        files = ModelFiles(tower=ggufs[0], head_weights=directory / HEAD_WEIGHTS,
                           head_config=directory / HEAD_CONFIG, tokenizer=directory / TOKENIZER,
                           name=directory.name)
    files.check_exist()
    return files
