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
    # resolved path -> (sha256, size, mtime_ns bound): a known hash is trusted only for the very
    # file it was computed on, unchanged since (same size, not modified after the bound).
    hashed: dict[str, tuple[str, int, int]] = field(default_factory=dict)

    def remember(self, path: Path, sha: str, size: int, as_of_ns: int) -> None:
        self.sha256[path.name] = sha
        self.hashed[str(Path(path).resolve())] = (sha, size, as_of_ns)

    def known_sha256(self, path: Path) -> str | None:
        """The recorded hash of ``path`` if it provably still describes the file, else None."""
        entry = self.hashed.get(str(Path(path).resolve()))
        try:
            st = Path(path).stat()
        except OSError:
            return None
        if entry and entry[1] == st.st_size and st.st_mtime_ns <= entry[2]:
            return entry[0]
        return None

    def sha256_of(self, path: Path) -> str:
        """The hash of the file that will actually run: recorded and still valid, or computed."""
        return self.known_sha256(path) or sha256_file(path)

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
                           revision=manifest.get("revision"))
        # The manifest is written after its files were hashed: a file changed later is newer.
        written_ns = (directory / MANIFEST).stat().st_mtime_ns
        for name, entry in manifest.get("files", {}).items():
            if isinstance(entry, dict) and isinstance(entry.get("sha256"), str) \
                    and isinstance(entry.get("size"), int):
                files.remember(directory / name, entry["sha256"], entry["size"], written_ns)
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
