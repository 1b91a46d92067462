"""NVFP4 checkpoint snapshots: a whole compressed-tensors repository, pulled into one snapshot directory.

An NVFP4 checkpoint (role nvfp4) is a repository, not a file: its top-level checkpoint files are
downloaded one by one through the same pinned, verified path as a GGUF (``download.fetch``) into the
HF cache's snapshot directory of one commit, which the nvfp4 backend loads (``files.from_directory``).
The head and tokenizer come from the family's release where the repository lacks them.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any

from clef_gguf.core.errors import ClefError, CorruptModel, ModelNotFound
from clef_gguf.formats.files import CHECKPOINT_CONFIG, ModelFiles, from_directory, is_compressed_tensors
from clef_gguf.models.catalog import Checkpoint, Family, FileEntry, Source
from clef_gguf.models.download import cached_main, commit_of, fetch, hub_errors, main_commit
from clef_gguf.models.hfcache import COMMIT_RE, cache_dir, endpoint, repo_dir, token
from clef_gguf.models.pins import pin

# file name -> (the Hub's LFS sha256 or None, size or None)
Listing = dict[str, tuple[str | None, int | None]]


def _spec(src: Source) -> Checkpoint:
    if src.checkpoint is None:
        raise ModelNotFound(f"{src.repo} is a {src.role} source, not a checkpoint directory", field="model")
    return src.checkpoint


def _checkpoint_commit(src: Source, *, name: str, local_only: bool, check_main: bool, update: bool) -> str:
    """The commit a checkpoint is taken at: the catalog's, the first pull's pin, or (first pull, or a
    pull checking the pin) the one main points to now, refused if it moved from the pin."""
    if src.revision is not None:  # pinned by the catalog
        return src.revision
    held = pin(src.repo)
    if local_only:  # a cache from before pins existed: what refs/main says; nothing: "main" fails clearly
        return held["commit"] if held else cached_main(src) or "main"
    if held and not check_main:
        return held["commit"]
    probe = CHECKPOINT_CONFIG  # every checkpoint has one: its HEAD says where main is
    commit, _ = main_commit(src, probe, held, name=name, update=update,
                            missing=f"{src.repo} at main lacks {probe}: not a checkpoint clef-gguf can pull")
    return commit


def _checkpoint_listing(src: Source, commit: str, *, local_only: bool) -> Listing:
    """file name -> (Hub LFS sha256 or None, size or None): the repository's top-level files at
    ``commit`` that a pull takes. Offline: what the cached snapshot and the pin know of."""
    ck = _spec(src)
    listed: Listing = {}
    if local_only:
        snap = repo_dir(src.repo) / "snapshots" / commit
        names = {p.name for p in snap.iterdir()} if snap.is_dir() else set()
        held = None if src.pinned else pin(src.repo)
        if held and held["commit"] == commit:
            names |= set(held.get("files", {}))  # pulled files deleted since: fetching them says so
        # The required files are named even if absent: fetching them gives the not-in-cache error.
        listed = {n: (None, None) for n in names | set(ck.required)}
    else:
        from huggingface_hub import HfApi

        with hub_errors(src, commit, "(the file listing)"):
            for item in HfApi(endpoint=endpoint(), token=token()).list_repo_tree(src.repo, revision=commit):
                if hasattr(item, "size"):  # a file, not a folder
                    lfs = getattr(item, "lfs", None)
                    listed[item.path] = (lfs.sha256 if lfs else None, item.size)
    # Top level only: the backend loads a flat checkpoint directory.
    return {n: v for n, v in listed.items()
            if "/" not in n and any(fnmatch.fnmatch(n, pat) for pat in ck.allow_patterns)}


def _index_shards(path: Path, label: str) -> set[str]:
    """The weight files a ``model.safetensors.index.json`` names."""
    try:
        weight_map = json.loads(path.read_bytes())["weight_map"]
        shards = set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptModel(f"{label} is not a safetensors index (no weight_map): {exc}", field="model") from None
    if not all(isinstance(s, str) and s and "/" not in s for s in shards):
        raise CorruptModel(f"{label} names weight files outside its directory", field="model")
    return shards


def materialize_checkpoint(src: Source, family: Family, *, name: str, local_only: bool, progress: bool,
                           check_main: bool = False, update: bool = False) -> ModelFiles:
    """An NVFP4 checkpoint directory: every checkpoint file of ``src`` at one commit, verified and
    pinned like a GGUF, in the HF cache's snapshot directory; the head and tokenizer from the
    family's head source where the repository lacks them."""
    ck = _spec(src)
    how: dict[str, Any] = dict(name=name, local_only=local_only, progress=progress, check_main=check_main,
                               update=update)
    commit = _checkpoint_commit(src, name=name, local_only=local_only, check_main=check_main, update=update)
    head = family.head_source
    head_names = set(family.head_files.values())
    # A commit whose snapshot is complete is listed from the cache: no request at all, like a cached GGUF.
    snap = repo_dir(src.repo) / "snapshots" / commit
    cached = bool(COMMIT_RE.match(commit)) and snap.is_dir() and _weights_complete(
        src, snap, {p.name for p in snap.iterdir()}, head_names)
    listed = _checkpoint_listing(src, commit, local_only=local_only or cached)
    where = f"{src.repo} at {commit}"
    missing = [f for f in ck.required if f not in listed]
    weights = [n for n in listed if fnmatch.fnmatch(n, ck.weights) and n not in head_names]
    if missing or not (weights or local_only):
        lacks = ", ".join(missing) or f"weight files ({ck.weights})"
        raise ModelNotFound(f"{where} lacks {lacks}: not a checkpoint clef-gguf can pull; it has "
                            f"{', '.join(sorted(listed)) or 'none of the checkpoint files'}", field="model")

    paths: dict[str, Path] = {}
    shas: dict[str, str] = {}

    def take(filename: str) -> None:
        sha, size = listed[filename]
        # A catalog-pinned source holds files to the Hub's LFS sha256 in the listing; one pinned at
        # first pull holds them to pins.json (fetch asks the Hub itself).
        entry = FileEntry(key=filename, file=filename, size=size if src.pinned else None,
                          sha256=sha if src.pinned else None)
        paths[filename], shas[filename] = fetch(src, filename, entry=entry, **how)

    # Small files first (auth or network problems show before GBs), the index before the shards.
    small = sorted((n for n in listed if not fnmatch.fnmatch(n, ck.weights)), key=lambda n: n != ck.index)
    for filename in small:
        take(filename)
    if ck.index in paths:
        shards = _index_shards(paths[ck.index], f"{src.repo} / {ck.index}")
        absent = sorted(shards - set(listed))
        if absent and not local_only:
            raise ModelNotFound(f"{where} lacks {', '.join(absent)}, named by its {ck.index}", field="model")
        listed.update({s: (None, None) for s in absent})  # offline: fetching them says they are not cached
    for filename in sorted(n for n in listed if n not in paths):
        take(filename)
    if not any(fnmatch.fnmatch(n, ck.weights) and n not in head_names for n in paths):
        # Only offline can get here (online, the listing was checked): a pull that stopped early.
        raise ModelNotFound(f"{where} is not complete in the Hugging Face cache ({cache_dir()}): no weight "
                            f"files; run `clef-gguf pull {name}` with network access", field="model")

    snap = paths[CHECKPOINT_CONFIG].parent  # the snapshot directory of ``commit``
    if not is_compressed_tensors(snap):
        raise CorruptModel(f"{src.repo} / {CHECKPOINT_CONFIG} at {commit} has no quantization_config with "
                           "quant_method compressed-tensors: not an NVFP4 checkpoint", field="model")
    heads: dict[str, Path] = {}
    from_head = False
    for key, file in family.head_files.items():
        if file in paths:
            heads[key] = paths[file]
        else:  # the repository lacks it: the family's own release has it, as for a GGUF tower
            heads[key], shas[file] = fetch(head, key, **how)
            paths[file], from_head = heads[key], True
    found = (from_directory(snap) if not from_head else
             ModelFiles(tower=snap / CHECKPOINT_CONFIG, head_weights=heads["head_weights"],
                        head_config=heads["head_config"], tokenizer=heads["tokenizer"], backend="nvfp4"))
    found.name = name
    found.revision = f"{src.repo}@{commit_of(paths[CHECKPOINT_CONFIG]) or commit}" + (
        f"; {head.repo}@{commit_of(heads['head_weights']) or head.revision}" if from_head else "")
    for filename, path in paths.items():
        st = path.stat()  # just verified: valid while the blob stays as it is now
        found.remember(path, shas[filename], st.st_size, st.st_mtime_ns)
    found.check_exist()
    return found


def _weights_complete(src: Source, snap: Path, names: set[str], head_names: set[str]) -> bool:
    """True if a cached snapshot (``names``: its files) holds the required files and weights, every
    shard its index names included (a pull fetches those last, so the small files are there too)."""
    ck = _spec(src)
    try:
        if not is_compressed_tensors(snap):
            return False
        if ck.index in names and not _index_shards(snap / ck.index, ck.index) <= names:
            return False
    except (OSError, ClefError):
        return False
    has_weights = any(fnmatch.fnmatch(n, ck.weights) and n not in head_names for n in names)
    return has_weights and set(ck.required) <= names


def checkpoint_ready(src: Source, snap: Path, names: set[str], head_names: set[str], head_cached: set[str]) -> bool:
    """A complete checkpoint, with each head file (``head_names``): its own, or the family's cached one."""
    return _weights_complete(src, snap, names, head_names) and head_names <= names | head_cached
