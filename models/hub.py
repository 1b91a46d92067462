"""Get catalog models into the Hugging Face cache: ``pull``, ``pull_file`` and ``resolve``.

A name (``FAMILY[:QUANT][@SOURCE]``) becomes verified files: a GGUF tower plus the head, head config,
tokenizer and vision part (``vision``) of the family's release, each fetched at its pinned revision
(``download``); a native clef-arch GGUF split on download into a model directory (``native``); or an
NVFP4 checkpoint repository as one snapshot directory (``checkpoint``). ``auto`` asks the placement policy, and
``resolve`` prefers what is already cached (``listing``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clef_gguf.core.errors import ModelNotFound, NoQuantFits
from clef_gguf.formats.files import ModelFiles
from clef_gguf.models.catalog import GGUF_SUFFIX, HEAD_KEYS, Catalog, Family, ModelRef, load_catalog
from clef_gguf.models.checkpoint import materialize_checkpoint
from clef_gguf.models.download import commit_of, fetch
from clef_gguf.models.hfcache import cache_dir, offline
from clef_gguf.models.listing import list_local
from clef_gguf.models.machine import DeviceProfile, probe
from clef_gguf.models.native import materialize_native
from clef_gguf.models.nvfp4_materialize import materialize_nvfp4_gguf
from clef_gguf.models.placement import DEFAULT_CONTEXT, Recommendation, recommend
from clef_gguf.models.vision import vision_part


def pull_file(name: str, *, allow_download: bool = True, progress: bool = True, quant: str | None = None,
              catalog: Catalog | None = None, update: bool = False) -> Path:
    """One verified GGUF (``NAME:QUANT@SOURCE``) of a source with quants; a native one as is."""
    cat = catalog or load_catalog()
    ref = cat.parse(name, quant)
    family = cat.family(ref.family)
    if ref.auto:
        raise ModelNotFound("pull_file needs an explicit quant", field="model")
    src = family.source(ref.source) if ref.source else family.tower_source(ref.quant)
    if src.checkpoint is not None:
        raise ModelNotFound(f"{src.repo} is a checkpoint directory, not one file: use pull", field="model")
    return fetch(src, ref.quant, name=f"{family.name}:{ref.quant}@{src.alias}",
                 local_only=not allow_download or offline(), progress=progress, check_main=True,
                 update=update)[0]


def _materialize(ref: ModelRef, family: Family, *, local_only: bool, progress: bool,
                 check_main: bool = False, update: bool = False) -> ModelFiles:
    src = family.tower_source(ref.quant, ref.source)
    name = f"{family.name}:{ref.quant}@{src.alias}"
    how: dict[str, Any] = dict(name=name, local_only=local_only, progress=progress, check_main=check_main,
                               update=update)
    if src.role == "native":
        return materialize_native(src, ref.quant, **how)
    if src.checkpoint is not None:
        checkpoint = materialize_checkpoint(src, family, **how)
        if ref.quant.endswith(GGUF_SUFFIX):  # clef-flash:nvfp4a16-gguf: re-encoded once, then cached
            return materialize_nvfp4_gguf(src, checkpoint, ref.quant, name=name)
        return checkpoint
    if src.role != "tower":
        raise ModelNotFound(f"{src.repo} is a {src.role} checkpoint, not a GGUF this runtime loads", field="model")
    head = family.head_source
    paths: dict[str, Path] = {}
    shas: dict[str, str] = {}
    for key in HEAD_KEYS:  # the small files first: auth or network problems show before a 6 GB transfer
        paths[key], shas[key] = fetch(head, key, **how)
    # The release's vision tower (the GGUF repos have none), at the head files' commit.
    vision = vision_part(head, commit_of(paths["head_weights"]) or head.revision, local_only=local_only,
                         progress=progress)
    tower, tower_sha = fetch(src, ref.quant, **how)
    revision = (f"{src.repo}@{commit_of(tower) or src.revision}; "
                f"{head.repo}@{commit_of(paths['head_weights']) or head.revision}")
    found = ModelFiles(tower=tower, head_weights=paths["head_weights"], head_config=paths["head_config"],
                       tokenizer=paths["tokenizer"], name=name, revision=revision, vision=vision)
    for path, sha in [*((paths[k], shas[k]) for k in HEAD_KEYS), (tower, tower_sha)]:
        st = path.stat()  # just verified: valid while the blob stays as it is now
        found.remember(path, sha, st.st_size, st.st_mtime_ns)
    return found


def auto_order(family: Family, alias: str | None, profile: DeviceProfile | None, context_tokens: int,
               catalog: Catalog) -> tuple[Recommendation, list[str]]:
    """The recommendation and the quants that fit, best first (limited to ``alias``'s quants if given)."""
    rec = recommend(profile or probe(), family, context_tokens=context_tokens, catalog=catalog)
    offered = set(family.source(alias).quants) if alias else None
    fitting = [c.quant for c in rec.candidates if c.fits and (offered is None or c.quant in offered)]
    if not fitting:
        raise NoQuantFits(rec.reason if not rec.ok else f"no quant of {alias} fits: {rec.reason}", field="model")
    return rec, fitting


def pull(name: str, *, allow_download: bool = True, progress: bool = True, quant: str | None = None,
         catalog: Catalog | None = None, profile: DeviceProfile | None = None,
         context_tokens: int = DEFAULT_CONTEXT, update: bool = False) -> ModelFiles:
    """Download (if needed) and verify tower GGUF + head + head config + tokenizer for ``name``.

    ``name`` is ``FAMILY[:QUANT][@SOURCE]``; ``auto`` (or no quant) asks the placement policy. A source
    pinned at first pull is checked against main: a moved commit or a changed file raises
    ``PinMismatch`` unless ``update``, which re-pins. A native clef-arch GGUF is split on download.
    """
    cat = catalog or load_catalog()
    ref = cat.parse(name, quant)
    family = cat.family(ref.family)
    if ref.auto:
        _, fitting = auto_order(family, ref.source, profile, context_tokens, cat)
        ref = ModelRef(family.name, fitting[0], ref.source)
    return _materialize(ref, family, local_only=not allow_download or offline(), progress=progress,
                        check_main=True, update=update)


def resolve(name: str, *, allow_download: bool = False, progress: bool = True, quant: str | None = None,
            catalog: Catalog | None = None, profile: DeviceProfile | None = None,
            context_tokens: int = DEFAULT_CONTEXT) -> ModelFiles:
    """Files for ``decide``/``serve --model NAME``: from the cache, downloading only if allowed.

    For ``auto``: the recommended quant if cached, else the best cached quant that still fits,
    else (when allowed) the recommended one is downloaded. A source pinned at first pull is used
    at its pinned commit (never checked against main: that is ``pull``'s job).
    """
    cat = catalog or load_catalog()
    ref = cat.parse(name, quant)
    family = cat.family(ref.family)
    local_only = not allow_download or offline()
    if ref.auto:
        rec, fitting = auto_order(family, ref.source, profile, context_tokens, cat)
        # Without @SOURCE only tower sources count (auto never means a native file), and a quant
        # cached from a non-default source is used from that source, not fetched from the default.
        towers = {s.alias for s in family.tower_sources}
        cached: dict[str, set[str]] = {}
        for m in list_local(catalog=cat):
            if m.family == family.name and m.head_ready and (m.pinned or not m.source_pinned) \
                    and (m.source == ref.source if ref.source else m.source in towers):
                cached.setdefault(m.quant, set()).add(m.source)
        pick = next((q for q in fitting if q in cached), None)
        if pick is None and local_only:
            raise ModelNotFound(f"no {family.name} quant that fits this machine is in the cache ({cache_dir()}); "
                                f"run `clef-gguf pull {family.name}:{fitting[0]}`. {rec.reason}", field="model")
        source = ref.source
        if pick is not None and source is None:
            default = family.tower_source(pick).alias
            source = default if default in cached[pick] else sorted(cached[pick])[0]
        ref = ModelRef(family.name, pick or fitting[0], source)
    return _materialize(ref, family, local_only=local_only, progress=progress)
