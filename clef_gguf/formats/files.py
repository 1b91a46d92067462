"""Where a model's four files are: a converted directory (with its manifest) or explicit paths.

A converted directory holds ``clef-gguf.json`` (written by ``clef-gguf convert``):

    {"format": "clef-gguf/1", "name": ..., "outtype": ...,
     "tower": "tower-f32.gguf", "head_weights": "joint_head.safetensors",
     "head_config": "joint_head_config.json", "tokenizer": "tokenizer.json",
     "files": {"tower-f32.gguf": {"sha256": ..., "size": ...}, ...}}
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePath

from clef_gguf.core.errors import ConversionError, CorruptModel, InvalidSetting, ModelNotFound
from clef_gguf.core.limits import MiB

MANIFEST = "clef-gguf.json"
MANIFEST_FORMAT = "clef-gguf/1"
HEAD_WEIGHTS = "joint_head.safetensors"
HEAD_CONFIG = "joint_head_config.json"
TOKENIZER = "tokenizer.json"
ROLES = ("tower", "head_weights", "head_config", "tokenizer")
CHECKPOINT_CONFIG = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> file map
# A model's vision tower: the release's ``vision_config`` (verbatim) and its vision tensors (prefix
# stripped, as stored), beside the tower (``convert``) or in their own directory (a catalog pull).
VISION_WEIGHTS = "vision.safetensors"
VISION_CONFIG = "vision_config.json"
# Where a release keeps its vision tensors (Qwen3.5: model.visual.; older Qwen-VL exports: visual.).
VISION_PREFIXES = ("model.visual.", "visual.")


@dataclass
class ModelFiles:
    tower: Path
    head_weights: Path
    head_config: Path
    tokenizer: Path
    name: str = "clef"
    revision: str | None = None
    # Which backend runs the tower (a name of ``runtime.backends.BACKENDS``, the registry): "gguf", a GGUF
    # run by llama.cpp, or "nvfp4", a compressed-tensors NVFP4 checkpoint run by PyTorch (``tower`` is
    # then the checkpoint's config.json; its safetensors lie beside it).
    backend: str = "gguf"
    # sha256 by file name, where a manifest or a catalog already knows it.
    sha256: dict[str, str] = field(default_factory=dict)
    # resolved path -> (sha256, size, mtime_ns bound): a known hash is trusted only for the very
    # file it was computed on, unchanged since (same size, not modified after the bound).
    hashed: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    # A merged fine-tune's provenance (its CLEF_FINETUNE.json, kept in the manifest as "finetune"):
    # the audit names it. None for a release that is not a fine-tune.
    fine_tune: dict | None = None
    # The directory holding the vision tower's files (VISION_CONFIG, VISION_WEIGHTS, processor settings),
    # or None: a GGUF model then looks beside its tower.
    vision: Path | None = None

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
            try:
                found = path.is_file()
            except OSError:  # a name too long for the file system: no such file either
                found = False
            if not found:
                raise ModelNotFound(f"{role} file not found: {path}", field=role)


def sha256_file(path: Path, chunk: int = 4 * MiB) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, name: str, outtype: str, roles: dict[str, str],
                   extra: dict | None = None, also: tuple[str, ...] = ()) -> Path:
    """Hash every file named in ``roles`` (role -> file name in ``directory``) and in ``also``
    (files the tower reads besides its role file: a checkpoint's shards), and write the manifest."""
    files = {}
    for file_name in [*roles.values(), *also]:
        path = directory / file_name
        files[file_name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    manifest = {"format": MANIFEST_FORMAT, "name": name, "outtype": outtype, **roles,
                "files": files, **(extra or {})}
    out = directory / MANIFEST
    out.write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def _inside(name: object) -> bool:
    """A file name that stays in the model directory: relative, no ``..``, not empty, no NUL."""
    if not isinstance(name, str) or "\x00" in name:
        return False
    parts = PurePath(name).parts
    return bool(parts) and not PurePath(name).is_absolute() and ".." not in parts


def _file_entry(entry: object) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
            and len(entry["sha256"]) == 64 and all(c in "0123456789abcdef" for c in entry["sha256"])
            and type(entry.get("size")) is int and entry["size"] >= 0)


def checked_manifest(path: Path, fmt: str, roles: tuple[str, ...], field: str) -> dict:
    """The JSON manifest at ``path``, checked: an object of format ``fmt`` naming each of ``roles``'
    files, a well-formed "files" table, no file name reaching outside its directory (a copied or
    downloaded manifest could point at any file on the machine). CorruptModel (``field``) if not."""

    def bad(why: str) -> CorruptModel:
        return CorruptModel(f"{path} {why}", field=field)

    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
        raise bad(f"is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise bad(f"is not a {fmt} manifest")
    missing = [role for role in roles if not isinstance(manifest.get(role), str)]
    if missing:
        raise bad(f"does not name the {', '.join(missing)} file(s)")
    listed = manifest.get("files", {})
    if not isinstance(listed, dict) or not all(map(_file_entry, listed.values())):
        raise bad('has a "files" table that is not {name: {"sha256": hex digest, "size": bytes}}')
    outside = [name for name in [manifest[role] for role in roles] + list(listed)
               if not _inside(name)]
    if outside:
        raise bad(f"names files outside its directory: {', '.join(map(repr, outside[:3]))}")
    return manifest


def read_manifest(directory: Path) -> dict:
    """A model directory's manifest, checked (``checked_manifest``, field "manifest")."""
    path = directory / MANIFEST
    manifest = checked_manifest(path, MANIFEST_FORMAT, ROLES, "manifest")
    if not isinstance(manifest.get("name", ""), str) \
            or not isinstance(manifest.get("revision"), (str, type(None))):
        raise CorruptModel(f"{path} has a name or revision that is not text", field="manifest")
    return manifest


def is_compressed_tensors(directory: Path) -> bool:
    """A Hugging Face checkpoint whose config.json says ``quant_method: compressed-tensors``."""
    try:
        config = json.loads((Path(directory) / CHECKPOINT_CONFIG).read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quant, dict) and quant.get("quant_method") == "compressed-tensors"


def _remember_manifest(files: ModelFiles, directory: Path, manifest: dict) -> None:
    """Trust the manifest's hashes for files unchanged since it was written (it is written after
    its files were hashed: a file changed later is newer)."""
    written_ns = (directory / MANIFEST).stat().st_mtime_ns
    if isinstance(manifest.get("finetune"), dict):
        files.fine_tune = manifest["finetune"]
    for name, entry in manifest.get("files", {}).items():
        if isinstance(entry, dict) and isinstance(entry.get("sha256"), str) \
                and isinstance(entry.get("size"), int):
            files.remember(directory / name, entry["sha256"], entry["size"], written_ns)


def from_directory(directory: Path, backend: str | None = None) -> ModelFiles:
    """Files of a converted model directory; a compressed-tensors checkpoint (the nvfp4 backend);
    without a manifest, the one ``*.gguf`` in it. ``backend="gguf"`` looks for the GGUF even in a
    directory that also holds a checkpoint."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelNotFound(f"model directory not found: {directory}", field="model")
    checkpoint = is_compressed_tensors(directory)
    manifest = read_manifest(directory) if (directory / MANIFEST).is_file() else None
    if checkpoint and backend != "gguf":
        files = ModelFiles(tower=directory / CHECKPOINT_CONFIG, head_weights=directory / HEAD_WEIGHTS,
                           head_config=directory / HEAD_CONFIG, tokenizer=directory / TOKENIZER,
                           name=directory.name, backend="nvfp4")
        if manifest is not None:  # written by `clef-gguf convert --outtype nvfp4*`
            files.name = str(manifest.get("name", directory.name))
            files.revision = manifest.get("revision")
            _remember_manifest(files, directory, manifest)
    elif manifest is not None and not (checkpoint and not manifest["tower"].endswith(".gguf")):
        files = ModelFiles(**{role: directory / manifest[role] for role in ROLES},
                           name=str(manifest.get("name", directory.name)),
                           revision=manifest.get("revision"))
        _remember_manifest(files, directory, manifest)
    else:
        ggufs = sorted(directory.glob("*.gguf"))
        if len(ggufs) != 1:
            found = ", ".join(p.name for p in ggufs) or "none"
            if checkpoint:  # --backend gguf on a compressed-tensors checkpoint
                raise InvalidSetting(f"--backend gguf needs a GGUF tower, but {directory} holds a "
                                     f"compressed-tensors NVFP4 checkpoint and {found} .gguf file(s)",
                                   field="backend")
            raise ModelNotFound(f"{directory} has no {MANIFEST} and not exactly one .gguf file "
                                f"(found: {found}); pass --gguf explicitly", field="model")
        files = ModelFiles(tower=ggufs[0], head_weights=directory / HEAD_WEIGHTS,
                           head_config=directory / HEAD_CONFIG, tokenizer=directory / TOKENIZER,
                           name=directory.name)
    if (directory / VISION_CONFIG).is_file():
        files.vision = directory
    files.check_exist()
    return files


@contextlib.contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """Write a model directory all or nothing: files go into a temporary directory beside ``out``,
    moved there complete when the block ends; a failure leaves no trace of them (and no ``out`` if
    there was none)."""
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out} exists and is not a directory", field="out")
    # In out's nearest existing ancestor: the same filesystem, so the final move is a rename, and
    # out's missing parents are only created once the directory is complete.
    base = out.parent
    while not base.is_dir():
        base = base.parent
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=base))
    try:
        yield stage
        _commit(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _commit(stage: Path, out: Path) -> None:
    if out.is_dir():
        # Never swap an existing out away (it may hold other files, or be someone's cwd): move
        # the new files in, the old manifest gone first, the new one last: none names a mix.
        manifests = {path.name for path in stage.iterdir() if path.name.startswith("clef-gguf")
                     and path.suffix == ".json"} | {MANIFEST}  # a model's or a fine-tune's
        for name in manifests:
            (out / name).unlink(missing_ok=True)
        for path in sorted(stage.iterdir(), key=lambda p: p.name in manifests):
            os.replace(path, out / path.name)
        stage.rmdir()
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(stage, out)  # the complete directory appears in one rename

