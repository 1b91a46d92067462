"""The cache listing: catalog models in the Hugging Face cache (``clef-gguf list``), and every model the
catalog can pull (``list --available``), with size, quant, pin and readiness."""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_gguf.formats.files import CHECKPOINT_CONFIG
from clef_gguf.models.catalog import GGUF_SUFFIX, Catalog, Family, Source, load_catalog
from clef_gguf.models.checkpoint import checkpoint_ready
from clef_gguf.models.hfcache import SHA256_RE, cache_dir, split_dir, stamp
from clef_gguf.models.first_use import conversion_is_current
from clef_gguf.models.pins import Pin, held_revision, read_pins

if TYPE_CHECKING:
    from huggingface_hub import CachedRepoInfo


@dataclass(frozen=True)
class LocalModel:
    name: str
    family: str
    quant: str
    source: str
    repo: str
    commit: str
    pinned: bool  # the cached commit is the pinned revision (the catalog's, or the first pull's)
    source_pinned: bool  # a revision is pinned for this source (by the catalog or a first pull)
    file: str
    path: Path
    size_bytes: int
    verified: bool  # hashed and matched the catalog's or the Hub's sha256
    # tower: head, head config and tokenizer are cached at the pinned revision; native: its split
    # model directory is complete and made from this file
    head_ready: bool
    pinned_by: str | None = None  # "catalog", "first pull", or None (nothing pinned yet)
    # "gguf", or "nvfp4": a checkpoint directory (``path``; ``file`` its config.json, ``size_bytes``
    # all its files, ``verified`` every file hashed and held to its reference, ``head_ready`` complete)
    backend: str = "gguf"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


def list_local(*, catalog: Catalog | None = None) -> list[LocalModel]:
    """Tower GGUFs and NVFP4 checkpoints of catalog sources in the HF cache, with size, quant and readiness."""
    cat = catalog or load_catalog()
    if not cache_dir().is_dir():
        return []
    from huggingface_hub import scan_cache_dir

    repos = {r.repo_id: r for r in scan_cache_dir(cache_dir()).repos if r.repo_type == "model"}
    pins = read_pins()
    out: list[LocalModel] = []
    for family in cat.families.values():
        head = family.head_source
        head_repo = repos.get(head.repo)
        # The head files cached at the head source's pinned revision.
        head_cached = {f.file_name for rev in (head_repo.revisions if head_repo else ())
                       if rev.commit_hash == head.revision for f in rev.files}
        head_ready = set(family.head_files.values()) <= head_cached
        for src in (s for s in family.sources if s.role in ("tower", "native") and s.repo in repos):
            held, by = held_revision(src, pins)
            for rev in repos[src.repo].revisions:
                for f in rev.files:
                    quant = _quant_of(src, f.file_name)
                    if quant is None:
                        continue
                    blob = f.blob_path.resolve()
                    checked = stamp(blob)
                    ready = head_ready if src.role == "tower" else conversion_is_current(
                        split_dir(src.repo, rev.commit_hash, quant), blob)
                    out.append(LocalModel(
                        name=f"{family.name}:{quant}@{src.alias}", family=family.name, quant=quant,
                        source=src.alias, repo=src.repo, commit=rev.commit_hash,
                        pinned=rev.commit_hash == held, source_pinned=held is not None,
                        file=f.file_name, path=f.file_path,
                        size_bytes=f.size_on_disk, verified=bool(checked and checked.get("checked")),
                        head_ready=ready, pinned_by=by))
        for src in (s for s in family.checkpoint_sources if s.repo in repos):
            out.extend(_local_checkpoints(src, family, repos[src.repo], pins, head_cached))
    return sorted(out, key=lambda m: (m.family, cat.quality_rank(m.quant), m.source))


def _local_checkpoints(src: Source, family: Family, repo: CachedRepoInfo, pins: dict[str, Pin],
                       head_cached: set[str]) -> list[LocalModel]:
    """One row per cached snapshot of a checkpoint repository that has its config.json."""
    held, by = held_revision(src, pins)
    quant = src.quants[0]  # a checkpoint source names its one scheme
    head_names = set(family.head_files.values())
    rows = []
    for rev in repo.revisions:
        files = {f.file_name: f for f in rev.files if "/" not in f.file_name}
        if CHECKPOINT_CONFIG not in files:
            continue
        # Verified: every file hashed since it was cached, and each with a reference hash (an LFS
        # sha256 blob name) matched it; a git-blob file (config.json) is held by pins.json instead.
        stamps = [stamp(f.blob_path.resolve()) for f in files.values()]
        verified = all(s and (s.get("checked") or not SHA256_RE.match(f.blob_path.name))
                       for s, f in zip(stamps, files.values()))
        rows.append(LocalModel(
            name=f"{family.name}:{quant}@{src.alias}", family=family.name,
            quant=quant, source=src.alias, repo=src.repo, commit=rev.commit_hash,
            pinned=rev.commit_hash == held, source_pinned=held is not None, file=CHECKPOINT_CONFIG,
            path=rev.snapshot_path, size_bytes=sum(f.size_on_disk for f in files.values()), verified=verified,
            head_ready=checkpoint_ready(src, rev.snapshot_path, set(files), head_names, head_cached),
            pinned_by=by, backend="nvfp4"))
    return rows


def _quant_of(src: Source, file_name: str) -> str | None:
    for quant, entry in src.files.items():
        pattern = src.pattern_for(quant)
        if entry.file == file_name or (entry.file is None and pattern is not None and
                                       fnmatch.fnmatch(file_name.lower(), pattern.lower())):
            return quant
    return None


def available(cat: Catalog) -> list[dict[str, Any]]:
    """Every GGUF and NVFP4 checkpoint the catalog can pull, one row per source and quant (best
    quality first; checkpoints after the GGUF quants). A size nobody published is None."""
    pins = read_pins()
    rows: list[dict[str, Any]] = []
    for family in cat.families.values():
        defaults = {q: family.tower_source(q).alias for q in family.quants() + family.checkpoint_quants()}
        for order, src in enumerate(s for s in family.sources if s.quants):
            revision, by = held_revision(src, pins)
            for quant in src.quants:
                known = src.checkpoint.known_size() if src.checkpoint else family.tower_size(quant, src.alias)
                size, basis = known or (None, "unknown")
                rows.append({"name": f"{family.name}:{quant}@{src.alias}", "family": family.name,
                             "quant": quant, "source": src.alias, "role": src.role,
                             "backend": "gguf" if quant.endswith(GGUF_SUFFIX) else src.backend,
                             "repo": src.repo, "revision": revision, "pinned_by": by,
                             "default": defaults.get(quant) == src.alias,
                             "size_bytes": size, "size_basis": basis, "_order": order})
    families = list(cat.families)
    rows.sort(key=lambda r: (families.index(r["family"]), cat.quality_rank(r["quant"]),
                             r["_order"]))
    return [{k: v for k, v in r.items() if k != "_order"} for r in rows]

