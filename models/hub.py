"""Get catalog models into the Hugging Face cache: ``pull``, ``resolve``, ``list_local``.

Downloads go through ``huggingface_hub.hf_hub_download`` at the catalog's pinned revisions, so the
files land in the ordinary HF cache (shared with every other HF tool), tokens and gated repos work as
usual, interrupted transfers are resumed by huggingface_hub, and its tqdm bars show progress. Every
file is hash-checked before it is handed out and a bad one is removed, never used (``hfcache``).
Environment (``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, ``HF_TOKEN``) is read
at call time.
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from clef_gguf.argtypes import positive_int
from clef_gguf.models.device import DEFAULT_CONTEXT, DeviceProfile, NoQuantFits, probe, recommend
from clef_gguf.errors import CorruptModel, ModelNotFound
from clef_gguf.files import ModelFiles
from clef_gguf.models.hfcache import SHA256_RE, cache_dir, endpoint, offline, repo_dir, stamp, token, verify
from clef_gguf.models.catalog import HEAD_KEYS, Catalog, Family, ModelRef, Source, load_catalog



# ---------------------------------------------------------------- fetching one file

class _SilentTqdm:
    """Progress sink for ``progress=False`` (a plain class: huggingface_hub then passes no extra kwargs)."""

    def __init__(self, *args, **kwargs):
        self.n = 0

    def update(self, n=1):
        self.n += n

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _download(src: Source, filename: str, *, local_only: bool, progress: bool,
              expected_sha: str | None = None, expected_size: int | None = None) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    revision = src.revision or "main"
    where = f"{src.repo}@{revision} / {filename}"
    kwargs = dict(repo_id=src.repo, filename=filename, revision=revision, cache_dir=str(cache_dir()),
                  endpoint=endpoint(), token=token())
    if not progress and "tqdm_class" in inspect.signature(hf_hub_download).parameters:
        kwargs["tqdm_class"] = _SilentTqdm  # older huggingface_hub has no tqdm_class: its bars stay on
    try:
        if src.pinned:  # pinned + cached: no network at all, whatever the mode
            try:
                return Path(hf_hub_download(**kwargs, local_files_only=True))
            except LocalEntryNotFoundError:
                if local_only:
                    raise
            try:
                _precheck(src, filename, revision, expected_sha, expected_size)
            except CorruptModel:
                raise
            except Exception:  # no metadata (network, odd mirror): the download reports it, or verify catches it
                pass
        return Path(hf_hub_download(**kwargs, local_files_only=local_only))
    except LocalEntryNotFoundError as exc:
        if not local_only:  # online, but the Hub could not be reached and nothing is cached
            raise ModelNotFound(f"cannot reach the Hub ({endpoint() or 'huggingface.co'}) for {where}, and it "
                                f"is not in the cache ({cache_dir()}): {exc}", field="model") from None
        why = "HF_HUB_OFFLINE is set" if offline() else "downloading was not allowed"
        raise ModelNotFound(f"{where} is not in the Hugging Face cache ({cache_dir()}) and {why}; "
                            "run `clef-gguf pull` with network access first", field="model") from None
    except GatedRepoError:
        raise ModelNotFound(f"{src.repo} is gated: accept its terms on the Hub and set HF_TOKEN",
                            field="model") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"repository {src.repo} not found (private? set HF_TOKEN)", field="model") from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"revision {revision} not found in {src.repo}", field="model") from None
    except EntryNotFoundError:
        raise ModelNotFound(f"{filename} not found in {src.repo} at {revision}", field="model") from None
    except HfHubHTTPError as exc:
        raise ModelNotFound(f"download of {where} failed: {exc}", field="model") from None
    except OSError as exc:  # size consistency check, disk space, connection
        raise ModelNotFound(f"download of {where} failed: {exc}", field="model") from None


def _precheck(src: Source, filename: str, revision: str, sha: str | None, size: int | None) -> None:
    """Before a long download: refuse if the Hub's file at the pinned revision is not the catalog's."""
    if not (sha or size):
        return
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    meta = get_hf_file_metadata(hf_hub_url(src.repo, filename, revision=revision, endpoint=endpoint()),
                                token=token())
    hub_sha = meta.etag if meta.etag and SHA256_RE.match(meta.etag) else None
    if (sha and hub_sha and hub_sha != sha) or (size and meta.size and meta.size != size):
        raise CorruptModel(f"{src.repo}@{revision} / {filename} on the Hub (sha256 {hub_sha}, {meta.size} "
                           f"bytes) is not the catalog's file (sha256 {sha}, {size} bytes); not downloading",
                           field="model")


def _discover(src: Source, quant: str, *, local_only: bool) -> tuple[str, str | None]:
    """(file name, Hub LFS sha256 or None) of a quant whose file name the catalog does not know."""
    pattern = (src.pattern_for(quant) or "").lower()
    listed: dict[str, str | None] = {}
    if local_only:
        ref = repo_dir(src.repo) / "refs" / "main"
        commit = src.revision or (ref.read_text().strip() if ref.is_file() else None)
        snap = repo_dir(src.repo) / "snapshots" / (commit or "-")
        for root, _, names in os.walk(snap):
            listed.update({str(Path(root, n).relative_to(snap)): None for n in names})
    else:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError
        try:
            for item in HfApi(endpoint=endpoint(), token=token()).list_repo_tree(
                    src.repo, revision=src.revision or "main", recursive=True):
                if hasattr(item, "size"):
                    listed[item.path] = item.lfs.sha256 if getattr(item, "lfs", None) else None
        except (HfHubHTTPError, OSError) as exc:
            raise ModelNotFound(f"cannot list {src.repo} to find its {quant} file: {exc}", field="model") from None
    hits = sorted(n for n in listed if fnmatch.fnmatch(n.rsplit("/", 1)[-1].lower(), pattern)
                  and "mmproj" not in n.lower())
    if len(hits) != 1:
        found = "no file" if not hits else f"several files ({', '.join(hits)})"
        where = "in the cache" if local_only else "on the Hub"
        raise ModelNotFound(f"{src.repo} has {found} matching {pattern} {where}", field="model")
    return hits[0], listed[hits[0]]


def _commit_of(path: Path) -> str | None:
    parts = path.parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts else None


# ---------------------------------------------------------------- public API

def pull_file(name: str, *, allow_download: bool = True, progress: bool = True, quant: str | None = None,
              catalog: Catalog | None = None) -> Path:
    """One verified GGUF of any source with quants, native-clef ones included (``NAME:QUANT@SOURCE``)."""
    cat = catalog or load_catalog()
    ref = cat.parse(name, quant)
    family = cat.family(ref.family)
    if ref.auto:
        raise ModelNotFound("pull_file needs an explicit quant", field="model")
    src = family.source(ref.source) if ref.source else family.tower_source(ref.quant)
    return _fetch_quant(src, ref.quant, local_only=not allow_download or offline(), progress=progress)[0]


def _fetch_quant(src: Source, quant: str, *, local_only: bool, progress: bool) -> tuple[Path, str]:
    entry = src.entry(quant)
    filename, expected = entry.file, entry.sha256
    if filename is None:
        filename, listed_sha = _discover(src, quant, local_only=local_only)
        expected = expected or listed_sha
    path = _download(src, filename, local_only=local_only, progress=progress,
                     expected_sha=expected, expected_size=entry.size)
    return path, verify(path, expected, f"{src.repo} / {filename}")


def _materialize(ref: ModelRef, family: Family, *, local_only: bool, progress: bool) -> ModelFiles:
    src = family.tower_source(ref.quant, ref.source)
    if src.role == "native":
        raise ModelNotFound(f"{src.repo} holds native arch-clef GGUFs (head inside) that llama-cpp-python "
                            f"0.3.36 cannot load. Pull {family.name}:{ref.quant} for a tower GGUF + head, or "
                            "fetch it with clef_gguf.models.hub.pull_file and run `clef-gguf convert split`.",
                            field="model")
    if src.role != "tower":
        raise ModelNotFound(f"{src.repo} is a {src.role} checkpoint, not a GGUF this runtime loads", field="model")
    head = family.head_source
    paths, shas = {}, {}
    for key in HEAD_KEYS:  # the small files first: auth or network problems show before a 6 GB transfer
        entry = head.entry(key)
        paths[key] = _download(head, entry.file, local_only=local_only, progress=progress,
                               expected_sha=entry.sha256, expected_size=entry.size)
        shas[paths[key]] = verify(paths[key], entry.sha256, f"{head.repo} / {entry.file}")
    tower, tower_sha = _fetch_quant(src, ref.quant, local_only=local_only, progress=progress)
    shas[tower] = tower_sha
    revision = (f"{src.repo}@{_commit_of(tower) or src.revision}; "
                f"{head.repo}@{_commit_of(paths['head_weights']) or head.revision}")
    found = ModelFiles(tower=tower, head_weights=paths["head_weights"], head_config=paths["head_config"],
                       tokenizer=paths["tokenizer"], name=f"{family.name}:{ref.quant}@{src.alias}",
                       revision=revision)
    for path, sha in shas.items():  # just verified: valid while the blob stays as it is now
        st = path.stat()
        found.remember(path, sha, st.st_size, st.st_mtime_ns)
    return found


def _auto_order(family: Family, alias: str | None, profile: DeviceProfile | None, context_tokens: int,
                catalog: Catalog):
    """The recommendation and the quants that fit, best first (limited to ``alias``'s quants if given)."""
    rec = recommend(profile or probe(), family, context_tokens=context_tokens, catalog=catalog)
    offered = set(family.source(alias).quants) if alias else None
    fitting = [c.quant for c in rec.candidates if c.fits and (offered is None or c.quant in offered)]
    if not fitting:
        raise NoQuantFits(rec.reason if not rec.ok else f"no quant of {alias} fits: {rec.reason}", field="model")
    return rec, fitting


def pull(name: str, *, allow_download: bool = True, progress: bool = True, quant: str | None = None,
         catalog: Catalog | None = None, profile: DeviceProfile | None = None,
         context_tokens: int = DEFAULT_CONTEXT) -> ModelFiles:
    """Download (if needed) and verify tower GGUF + head + head config + tokenizer for ``name``.

    ``name`` is ``FAMILY[:QUANT][@SOURCE]``; ``auto`` (or no quant) asks the device policy.
    """
    cat = catalog or load_catalog()
    ref = cat.parse(name, quant)
    family = cat.family(ref.family)
    if ref.auto:
        _, fitting = _auto_order(family, ref.source, profile, context_tokens, cat)
        ref = ModelRef(family.name, fitting[0], ref.source)
    return _materialize(ref, family, local_only=not allow_download or offline(), progress=progress)


def resolve(name: str, *, allow_download: bool = False, progress: bool = True, quant: str | None = None,
            catalog: Catalog | None = None, profile: DeviceProfile | None = None,
            context_tokens: int = DEFAULT_CONTEXT) -> ModelFiles:
    """Files for ``decide``/``serve --model NAME``: from the cache, downloading only if allowed.

    For ``auto``: the recommended quant if cached, else the best cached quant that still fits,
    else (when allowed) the recommended one is downloaded.
    """
    cat = catalog or load_catalog()
    ref = cat.parse(name, quant)
    family = cat.family(ref.family)
    local_only = not allow_download or offline()
    if ref.auto:
        rec, fitting = _auto_order(family, ref.source, profile, context_tokens, cat)
        cached = {m.quant for m in list_local(catalog=cat) if m.family == family.name and m.head_ready
                  and (m.pinned or not m.source_pinned)
                  and (ref.source is None or m.source == ref.source)}
        pick = next((q for q in fitting if q in cached), None)
        if pick is None and local_only:
            raise ModelNotFound(f"no {family.name} quant that fits this machine is in the cache ({cache_dir()}); "
                                f"run `clef-gguf pull {family.name}:{fitting[0]}`. {rec.reason}", field="model")
        ref = ModelRef(family.name, pick or fitting[0], ref.source)
    return _materialize(ref, family, local_only=local_only, progress=progress)


@dataclass(frozen=True)
class LocalModel:
    name: str
    family: str
    quant: str
    source: str
    repo: str
    commit: str
    pinned: bool  # the cached commit is the catalog's pinned revision
    source_pinned: bool  # the catalog pins this source at all
    file: str
    path: Path
    size_bytes: int
    verified: bool  # hashed and matched the catalog's or the Hub's sha256
    head_ready: bool  # head, head config and tokenizer are cached at the pinned revision

    def to_dict(self) -> dict:
        return {**asdict(self), "path": str(self.path)}


def list_local(*, catalog: Catalog | None = None) -> list[LocalModel]:
    """Tower GGUFs of catalog sources in the HF cache, with size, quant and readiness."""
    cat = catalog or load_catalog()
    if not cache_dir().is_dir():
        return []
    from huggingface_hub import scan_cache_dir

    repos = {r.repo_id: r for r in scan_cache_dir(cache_dir()).repos if r.repo_type == "model"}
    out = []
    for family in cat.families.values():
        head = family.head_source
        head_repo = repos.get(head.repo)
        head_ready = bool(head_repo) and any(
            rev.commit_hash == head.revision and {head.files[k].file for k in HEAD_KEYS}
            <= {f.file_name for f in rev.files} for rev in head_repo.revisions)
        for src in (s for s in family.sources if s.role in ("tower", "native") and s.repo in repos):
            for rev in repos[src.repo].revisions:
                for f in rev.files:
                    quant = _quant_of(src, f.file_name)
                    if quant is None:
                        continue
                    checked = stamp(f.blob_path.resolve())
                    out.append(LocalModel(
                        name=f"{family.name}:{quant}@{src.alias}", family=family.name, quant=quant,
                        source=src.alias, repo=src.repo, commit=rev.commit_hash,
                        pinned=rev.commit_hash == src.revision, source_pinned=src.pinned,
                        file=f.file_name, path=f.file_path,
                        size_bytes=f.size_on_disk, verified=bool(checked and checked.get("checked")),
                        head_ready=head_ready and src.role == "tower"))
    return sorted(out, key=lambda m: (m.family, cat.quality_rank(m.quant), m.source))


def _quant_of(src: Source, file_name: str) -> str | None:
    for quant, entry in src.files.items():
        if entry.file == file_name or (entry.file is None and src.file_pattern and
                                       fnmatch.fnmatch(file_name.lower(), src.pattern_for(quant).lower())):
            return quant
    return None


# ---------------------------------------------------------------- CLI: clef-gguf pull / list

def add_pull_arguments(parser) -> None:
    parser.add_argument("name", help="clef-flash, clef-flash:Q4_K_M, clef:Q4_K_M, clef-flash:auto[@SOURCE]")
    parser.add_argument("--quant", help="quant type or 'auto' (overrides :QUANT in the name)")
    parser.add_argument("--ctx", type=positive_int, default=DEFAULT_CONTEXT, help="context the auto choice budgets for")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="print the resulting files as JSON")


def run_pull(args) -> int:
    cat = load_catalog()
    ref = cat.parse(args.name, args.quant)
    family = cat.family(ref.family)
    if ref.auto:
        rec, fitting = _auto_order(family, ref.source, None, args.ctx, cat)
        print(f"auto: {rec.reason}", file=sys.stderr)
        ref = ModelRef(family.name, fitting[0], ref.source)
    src = family.tower_source(ref.quant, ref.source)
    if not src.pinned:
        print(f"warning: {src.repo} has no pinned revision in the catalog; pulling what main points to now",
              file=sys.stderr)
    files = pull(str(ref), progress=not args.no_progress, catalog=cat)
    if args.json:
        print(json.dumps({"name": files.name, "revision": files.revision, "sha256": files.sha256,
                          **{k: str(v) for k, v in files.paths().items()}}, indent=2))
    else:
        print(f"{files.name}  ({files.revision})")
        for role, path in files.paths().items():
            print(f"  {role:<13} {path}")
    return 0


def add_list_arguments(parser) -> None:
    parser.add_argument("--available", action="store_true", help="list the catalog instead of the cache")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run_list(args) -> int:
    cat = load_catalog()
    if args.available:
        rows = []
        for family in cat.families.values():
            for quant in family.quants():
                src = family.tower_source(quant)
                size, basis = family.tower_size(quant)
                rows.append({"name": f"{family.name}:{quant}", "source": src.alias, "repo": src.repo,
                             "revision": src.revision, "size_bytes": size, "size_basis": basis})
        if args.json:
            print(json.dumps(rows, indent=2))
        for r in [] if args.json else rows:
            rev = (r["revision"] or "unpinned")[:10]
            print(f"{r['name']:<20} {r['size_bytes'] / 1e9:6.2f} GB ({r['size_basis']:<8}) {r['source']:<12} {rev}")
        return 0
    models = list_local(catalog=cat)
    if args.json:
        print(json.dumps([m.to_dict() for m in models], indent=2))
        return 0
    if not models:
        print(f"no Clef models in the Hugging Face cache ({cache_dir()}); try `clef-gguf pull clef-flash`")
    for m in models:
        state = ("ready" if m.head_ready else "head missing") + (", verified" if m.verified else "")
        rev = m.commit[:10] + ("" if m.pinned else " (unpinned source)" if not m.source_pinned
                               else " (not the pinned revision)")
        print(f"{m.name:<32} {m.size_bytes / 1e9:6.2f} GB  {rev:<12} {state}")
    return 0
