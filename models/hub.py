"""Get catalog models into the Hugging Face cache: ``pull``, ``resolve``, ``list_local``.

Downloads go through ``huggingface_hub.hf_hub_download`` at the catalog's pinned revisions, so the
files land in the ordinary HF cache (shared with every other HF tool), tokens and gated repos work as
usual, interrupted transfers are resumed by huggingface_hub, and its tqdm bars show progress. Every
file is hash-checked before it is handed out and a bad one is removed, never used (``hfcache``).
A source the catalog does not pin (``revision: null``) is pinned at its first pull (``hfcache``
pins); a native clef-arch GGUF is split on download into a model directory this runtime loads. An
NVFP4 checkpoint (role nvfp4) is a whole repository: its top-level checkpoint files are downloaded one
by one through the same pinned, verified path into one snapshot directory, which the nvfp4 backend
loads (``files.from_directory``).
Environment (``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, ``HF_TOKEN``) is read
at call time.
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from clef_gguf.argtypes import positive_int
from clef_gguf.models.device import DEFAULT_CONTEXT, DeviceProfile, NoQuantFits, probe, recommend
from clef_gguf.errors import ClefError, ConversionError, CorruptModel, ModelLoadError, ModelNotFound
from clef_gguf.files import (CHECKPOINT_CONFIG, MANIFEST, ROLES, ModelFiles, from_directory,
                             is_compressed_tensors, read_manifest)
from clef_gguf.models.hfcache import (COMMIT_RE, SHA256_RE, PinMismatch, cache_dir,
                                      changed_message, endpoint, moved_message, offline, pin,
                                      pinned_sha, pins_path, read_pins, record_pin, repo_dir,
                                      split_dir, stamp, token, verify)
from clef_gguf.models.catalog import HEAD_KEYS, Catalog, Family, FileEntry, ModelRef, Source, load_catalog

# A split copies the whole tower (GBs); a second process wanting the same split waits for it.
SPLIT_LOCK_TIMEOUT_S = 3600


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


@contextmanager
def _hub_errors(src: Source, revision: str, filename: str):
    """huggingface_hub's errors as ModelNotFound saying what to do."""
    from huggingface_hub import errors as hf_errors
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    # The transport's base class (connection refused, timeouts); older releases raise OSErrors.
    transport = getattr(hf_errors, "HTTPError", OSError)
    where = f"{src.repo}@{revision} / {filename}"
    try:
        yield
    except GatedRepoError:
        raise ModelNotFound(f"{src.repo} is gated: accept its terms on the Hub and set HF_TOKEN",
                            field="model") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"repository {src.repo} not found (private? set HF_TOKEN)",
                            field="model") from None
    except RevisionNotFoundError:
        why = "" if src.pinned else (f" (pinned at the first pull, {pins_path()}; `clef-gguf pull "
                                     f"{src.family}:QUANT@{src.alias} --update` pins main again)")
        raise ModelNotFound(f"revision {revision} not found in {src.repo}{why}",
                            field="model") from None
    except EntryNotFoundError:
        raise ModelNotFound(f"{filename} not found in {src.repo} at {revision}",
                            field="model") from None
    except (HfHubHTTPError, OSError, transport) as exc:  # HTTP status, size check, disk, connection
        raise ModelNotFound(f"download of {where} failed: {exc}", field="model") from None


def _download(src: Source, filename: str, revision: str, *, local_only: bool, progress: bool,
              expected_sha: str | None = None, expected_size: int | None = None,
              mismatch=None, refresh: bool = False) -> Path:
    """One file of ``src`` at ``revision`` (a commit, or "main" for an unpinned cache), cached.

    ``mismatch(hub_sha, hub_size)`` makes the error for a Hub file that is not the expected one;
    ``refresh`` downloads again although the commit's file is cached (a re-pinned changed file)."""
    if refresh:  # huggingface_hub never re-points an existing snapshot link, even when forced
        (repo_dir(src.repo) / "snapshots" / revision / filename).unlink(missing_ok=True)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"{src.repo}@{revision} / {filename}"
    kwargs = dict(repo_id=src.repo, filename=filename, revision=revision,
                  cache_dir=str(cache_dir()), endpoint=endpoint(), token=token())
    if not progress and "tqdm_class" in inspect.signature(hf_hub_download).parameters:
        kwargs["tqdm_class"] = _SilentTqdm  # older huggingface_hub has no tqdm_class: bars stay on
    with _hub_errors(src, revision, filename):
        try:
            if COMMIT_RE.match(revision):
                try:  # a commit + cached: no network at all, whatever the mode
                    return Path(hf_hub_download(**kwargs, local_files_only=True))
                except LocalEntryNotFoundError:
                    if local_only:
                        raise
                try:
                    _precheck(src, filename, revision, expected_sha, expected_size, mismatch)
                except ClefError:
                    raise
                except Exception:  # no metadata (network, odd mirror): the download reports it,
                    pass  # or verify catches it
            return Path(hf_hub_download(**kwargs, local_files_only=local_only))
        except LocalEntryNotFoundError as exc:
            if not local_only:  # online, but the Hub could not be reached and nothing is cached
                raise ModelNotFound(f"cannot reach the Hub ({endpoint() or 'huggingface.co'}) for "
                                    f"{where}, and it is not in the cache ({cache_dir()}): {exc}",
                                    field="model") from None
            why = "HF_HUB_OFFLINE is set" if offline() else "downloading was not allowed"
            raise ModelNotFound(f"{where} is not in the Hugging Face cache ({cache_dir()}) and "
                                f"{why}; run `clef-gguf pull` with network access first",
                                field="model") from None


def _hub_file(src: Source, filename: str,
              revision: str) -> tuple[str | None, str | None, int | None]:
    """(commit, LFS sha256 or None, size) of a file on the Hub at ``revision``: one HEAD request."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(src.repo, filename, revision=revision, endpoint=endpoint())
    meta = get_hf_file_metadata(url, token=token())
    sha = meta.etag if meta.etag and SHA256_RE.match(meta.etag) else None
    return meta.commit_hash, sha, meta.size


def _precheck(src: Source, filename: str, revision: str, sha: str | None, size: int | None,
              mismatch=None) -> None:
    """Before a long download: refuse a Hub file at the pinned commit that is not the expected."""
    if not (sha or size):
        return
    _, hub_sha, hub_size = _hub_file(src, filename, revision)
    if (sha and hub_sha and hub_sha != sha) or (size and hub_size and hub_size != size):
        if mismatch is not None:
            raise mismatch(hub_sha, hub_size)
        raise CorruptModel(f"{src.repo}@{revision} / {filename} on the Hub (sha256 {hub_sha}, "
                           f"{hub_size} bytes) is not the catalog's file (sha256 {sha}, {size} "
                           "bytes); not downloading", field="model")


def _cached_main(src: Source) -> str | None:
    """The commit main pointed to when huggingface_hub last downloaded ``src`` (pre-pin caches)."""
    ref = repo_dir(src.repo) / "refs" / "main"
    return ref.read_text().strip() if ref.is_file() else None


def _discover(src: Source, quant: str, revision: str | None, *,
              local_only: bool) -> tuple[str, str | None]:
    """(file name, Hub LFS sha256 or None) of a quant whose file name the catalog does not know."""
    pattern = (src.pattern_for(quant) or "").lower()
    listed: dict[str, str | None] = {}
    if local_only:
        commit = revision if revision and COMMIT_RE.match(revision) else _cached_main(src)
        snap = repo_dir(src.repo) / "snapshots" / (commit or "-")
        for root, _, names in os.walk(snap):
            listed.update({str(Path(root, n).relative_to(snap)): None for n in names})
    else:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError
        try:
            for item in HfApi(endpoint=endpoint(), token=token()).list_repo_tree(
                    src.repo, revision=revision or "main", recursive=True):
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


def _fetch(src: Source, key: str, *, name: str, local_only: bool, progress: bool,
           check_main: bool = False, update: bool = False,
           entry: FileEntry | None = None) -> tuple[Path, str]:
    """(path, sha256) of one verified file of ``src``: ``key`` is a quant or a head role, or, with
    ``entry``, any file (one file of a checkpoint repository).

    ``name`` is the model name a PinMismatch tells the user to pull with --update. ``check_main``
    (pull): for a source pinned at first pull, ask the Hub where main is now and refuse a move;
    without it (resolve), the pinned commit is used as it is."""
    entry = entry or src.entry(key)
    label = f"{src.repo} / {entry.file or key}"
    if src.pinned:
        filename, expected = entry.file, entry.sha256
        if filename is None:
            filename, listed_sha = _discover(src, key, src.revision, local_only=local_only)
            expected = expected or listed_sha
        path = _download(src, filename, src.revision, local_only=local_only, progress=progress,
                         expected_sha=expected, expected_size=entry.size)
        return path, verify(path, expected, f"{src.repo} / {filename}")

    held = pin(src.repo)
    if local_only:  # the pinned commit; a cache from before pins existed: what refs/main says
        commit = held["commit"] if held else _cached_main(src)
        filename = entry.file or _discover(src, key, commit, local_only=True)[0]
        path = _download(src, filename, commit or "main", local_only=True, progress=progress)
        return path, verify(path, pinned_sha(held, filename), label)

    hub_sha, refresh = None, False
    if held and not check_main:
        commit = held["commit"]
        filename = entry.file or _discover(src, key, commit, local_only=False)[0]
        expected = pinned_sha(held, filename)
    else:  # the first pull, or a pull checking that main is still the pin
        filename = entry.file or _discover(src, key, "main", local_only=False)[0]
        with _hub_errors(src, "main", filename):
            commit, hub_sha, _ = _hub_file(src, filename, "main")
        if not commit:
            raise ModelNotFound(f"{endpoint() or 'the Hub'} did not say which commit {src.repo}'s "
                                "main is (no X-Repo-Commit header), so it cannot be pinned",
                                field="model")
        if held and held["commit"] != commit and not update:
            raise PinMismatch(moved_message(src.repo, held, commit, name), field="model")
        expected = pinned_sha(held, filename) if held and held["commit"] == commit else None
        if expected and hub_sha and hub_sha != expected:
            if not update:
                raise PinMismatch(changed_message(src.repo, filename, commit, expected, hub_sha,
                                                  name), field="model")
            # Same commit, new bytes (only a rewritten mirror does that): the cached copy is old.
            expected, refresh = None, True
        expected = expected or hub_sha

    def mismatch(now, _size):
        return PinMismatch(changed_message(src.repo, filename, commit, expected, now, name),
                           field="model")

    path = _download(src, filename, commit, local_only=False, progress=progress,
                     expected_sha=expected, mismatch=mismatch, refresh=refresh)
    sha = verify(path, expected, f"{src.repo} / {filename}")
    record_pin(src.repo, commit, filename, sha, path.stat().st_size, update=update, name=name)
    return path, sha


# ---------------------------------------------------------------- public API

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
    return _fetch(src, ref.quant, name=f"{family.name}:{ref.quant}@{src.alias}",
                  local_only=not allow_download or offline(), progress=progress, check_main=True,
                  update=update)[0]


def _materialize(ref: ModelRef, family: Family, *, local_only: bool, progress: bool,
                 check_main: bool = False, update: bool = False) -> ModelFiles:
    src = family.tower_source(ref.quant, ref.source)
    name = f"{family.name}:{ref.quant}@{src.alias}"
    how = dict(name=name, local_only=local_only, progress=progress, check_main=check_main,
               update=update)
    if src.role == "native":
        return _materialize_native(src, ref.quant, **how)
    if src.checkpoint is not None:
        return _materialize_checkpoint(src, family, **how)
    if src.role != "tower":
        raise ModelNotFound(f"{src.repo} is a {src.role} checkpoint, not a GGUF this runtime loads", field="model")
    head = family.head_source
    paths, shas = {}, {}
    for key in HEAD_KEYS:  # the small files first: auth or network problems show before a 6 GB transfer
        paths[key], shas[key] = _fetch(head, key, **how)
    tower, tower_sha = _fetch(src, ref.quant, **how)
    revision = (f"{src.repo}@{_commit_of(tower) or src.revision}; "
                f"{head.repo}@{_commit_of(paths['head_weights']) or head.revision}")
    found = ModelFiles(tower=tower, head_weights=paths["head_weights"], head_config=paths["head_config"],
                       tokenizer=paths["tokenizer"], name=name, revision=revision)
    for path, sha in [*((paths[k], shas[k]) for k in HEAD_KEYS), (tower, tower_sha)]:
        st = path.stat()  # just verified: valid while the blob stays as it is now
        found.remember(path, sha, st.st_size, st.st_mtime_ns)
    return found


def _materialize_native(src: Source, quant: str, *, name: str, **how) -> ModelFiles:
    """A native clef-arch GGUF (head inside) as a model directory llama-cpp-python 0.3.36 loads.

    The download is split once into ``$HF_HOME/clef-gguf/split/<repo>@<commit>/<quant>/`` (qwen35
    tower, head files, tokenizer.json rebuilt from the GGUF's vocabulary); later resolves reuse it
    while it was made from the same cached blob, and split again if the blob changed."""
    native, _ = _fetch(src, quant, name=name, **how)
    commit = _commit_of(native) or src.revision or "main"
    out = split_dir(src.repo, commit, quant)
    found = _split_once(native, out, name, f"{src.repo} / {native.name}")
    found.revision = f"{src.repo}@{commit} (native GGUF, split by clef-gguf)"
    return found


def _checkpoint_commit(src: Source, *, name: str, local_only: bool, check_main: bool, update: bool) -> str:
    """The commit a checkpoint is taken at: the catalog's, the first pull's pin, or (first pull, or a
    pull checking the pin) the one main points to now, refused if it moved from the pin."""
    if src.pinned:
        return src.revision
    held = pin(src.repo)
    if local_only:  # a cache from before pins existed: what refs/main says; nothing: "main" fails clearly
        return held["commit"] if held else _cached_main(src) or "main"
    if held and not check_main:
        return held["commit"]
    from huggingface_hub.errors import EntryNotFoundError

    probe = CHECKPOINT_CONFIG  # every checkpoint has one: its HEAD says where main is
    with _hub_errors(src, "main", probe):
        try:
            commit, _, _ = _hub_file(src, probe, "main")
        except EntryNotFoundError:
            raise ModelNotFound(f"{src.repo} at main lacks {probe}: not a checkpoint clef-gguf can pull",
                                field="model") from None
    if not commit:
        raise ModelNotFound(f"{endpoint() or 'the Hub'} did not say which commit {src.repo}'s main is "
                            "(no X-Repo-Commit header), so it cannot be pinned", field="model")
    if held and held["commit"] != commit and not update:
        raise PinMismatch(moved_message(src.repo, held, commit, name), field="model")
    return commit


def _checkpoint_listing(src: Source, commit: str, *, local_only: bool) -> dict[str, tuple[str | None, int | None]]:
    """file name -> (Hub LFS sha256 or None, size or None): the repository's top-level files at
    ``commit`` that a pull takes. Offline: what the cached snapshot and the pin know of."""
    ck = src.checkpoint
    listed: dict[str, tuple[str | None, int | None]] = {}
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

        with _hub_errors(src, commit, "(the file listing)"):
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


def _materialize_checkpoint(src: Source, family: Family, *, name: str, local_only: bool, progress: bool,
                            check_main: bool = False, update: bool = False) -> ModelFiles:
    """An NVFP4 checkpoint directory: every checkpoint file of ``src`` at one commit, verified and
    pinned like a GGUF, in the HF cache's snapshot directory; the head and tokenizer from the
    family's head source where the repository lacks them."""
    ck = src.checkpoint
    how = dict(name=name, local_only=local_only, progress=progress, check_main=check_main, update=update)
    commit = _checkpoint_commit(src, name=name, local_only=local_only, check_main=check_main, update=update)
    head = family.head_source
    head_names = {head.files[k].file for k in HEAD_KEYS}
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

    def fetch(filename: str) -> None:
        sha, size = listed[filename]
        # A catalog-pinned source holds files to the Hub's LFS sha256 in the listing; one pinned at
        # first pull holds them to pins.json (_fetch asks the Hub itself).
        entry = FileEntry(key=filename, file=filename, size=size if src.pinned else None,
                          sha256=sha if src.pinned else None)
        paths[filename], shas[filename] = _fetch(src, filename, entry=entry, **how)

    # Small files first (auth or network problems show before GBs), the index before the shards.
    small = sorted((n for n in listed if not fnmatch.fnmatch(n, ck.weights)), key=lambda n: n != ck.index)
    for filename in small:
        fetch(filename)
    if ck.index in paths:
        shards = _index_shards(paths[ck.index], f"{src.repo} / {ck.index}")
        absent = sorted(shards - set(listed))
        if absent and not local_only:
            raise ModelNotFound(f"{where} lacks {', '.join(absent)}, named by its {ck.index}", field="model")
        listed.update({s: (None, None) for s in absent})  # offline: fetching them says they are not cached
    for filename in sorted(n for n in listed if n not in paths):
        fetch(filename)
    if not any(fnmatch.fnmatch(n, ck.weights) and n not in head_names for n in paths):
        # Only offline can get here (online, the listing was checked): a pull that stopped early.
        raise ModelNotFound(f"{where} is not complete in the Hugging Face cache ({cache_dir()}): no weight "
                            f"files; run `clef-gguf pull {name}` with network access", field="model")

    snap = paths[CHECKPOINT_CONFIG].parent  # the snapshot directory of ``commit``
    if not is_compressed_tensors(snap):
        raise CorruptModel(f"{src.repo} / {CHECKPOINT_CONFIG} at {commit} has no quantization_config with "
                           "quant_method compressed-tensors: not an NVFP4 checkpoint", field="model")
    heads, from_head = {}, False
    for key in HEAD_KEYS:
        if head.files[key].file in paths:
            heads[key] = paths[head.files[key].file]
        else:  # the repository lacks it: the family's own release has it, as for a GGUF tower
            heads[key], shas[head.files[key].file] = _fetch(head, key, **how)
            paths[head.files[key].file], from_head = heads[key], True
    found = (from_directory(snap) if not from_head else
             ModelFiles(tower=snap / CHECKPOINT_CONFIG, **heads, backend="nvfp4"))
    found.name = name
    found.revision = f"{src.repo}@{_commit_of(paths[CHECKPOINT_CONFIG]) or commit}" + (
        f"; {head.repo}@{_commit_of(heads['head_weights']) or head.revision}" if from_head else "")
    for filename, path in paths.items():
        st = path.stat()  # just verified: valid while the blob stays as it is now
        found.remember(path, shas[filename], st.st_size, st.st_mtime_ns)
    found.check_exist()
    return found


def _weights_complete(src: Source, snap: Path, names: set[str], head_names: set[str]) -> bool:
    """True if a cached snapshot (``names``: its files) holds the required files and weights, every
    shard its index names included (a pull fetches those last, so the small files are there too)."""
    ck = src.checkpoint
    try:
        if not is_compressed_tensors(snap):
            return False
        if ck.index in names and not _index_shards(snap / ck.index, ck.index) <= names:
            return False
    except (OSError, ClefError):
        return False
    has_weights = any(fnmatch.fnmatch(n, ck.weights) and n not in head_names for n in names)
    return has_weights and set(ck.required) <= names


def _checkpoint_ready(src: Source, snap: Path, names: set[str], head: Source, head_cached: set[str]) -> bool:
    """A complete checkpoint, with each head file: its own, or the family's cached one."""
    head_names = {head.files[k].file for k in HEAD_KEYS}
    return _weights_complete(src, snap, names, head_names) and head_names <= names | head_cached


def _split_is_current(out: Path, blob: Path) -> bool:
    """True if ``out`` is a complete split of this very blob, unchanged since."""
    try:
        manifest = read_manifest(out)
        made_ns = (out / MANIFEST).stat().st_mtime_ns
        # The blob's path names its content (the HF cache names blobs by hash); a blob rewritten
        # after the split (a re-download) is newer than the manifest written at the split's end.
        return ((manifest.get("source") or {}).get("path") == str(blob)
                and blob.stat().st_mtime_ns <= made_ns
                and all((out / manifest[role]).is_file() for role in ROLES))
    except (OSError, ClefError):
        return False


def _split_once(native: Path, out: Path, name: str, label: str) -> ModelFiles:
    # Under a lock: two processes resolving the same model must not both copy a 6 GB tower. The
    # split stages beside ``out`` and renames it into place, so ``out`` is complete or absent.
    blob = native.resolve()
    lock = out.parent / f".{out.name}.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock), timeout=SPLIT_LOCK_TIMEOUT_S):
            if not _split_is_current(out, blob):
                shutil.rmtree(out, ignore_errors=True)  # made from another blob, or incomplete
                # A killed split leaves its stage; holding the lock, nobody else is using one.
                for stage in out.parent.glob(f".{out.name}.split-*"):
                    shutil.rmtree(stage, ignore_errors=True)
                from clef_gguf.convert.split import split_native  # torch + gguf: only to split

                try:
                    split_native(native, out, name=name)
                except ConversionError as exc:
                    raise ConversionError(f"cannot split the native GGUF {label}: {exc.message}",
                                          field="model") from None
            return from_directory(out)
    except Timeout:
        raise ModelLoadError(f"{lock} stayed locked for {SPLIT_LOCK_TIMEOUT_S} s (another process "
                             "splitting the same file?)", field="model") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot split {label} into {out}: {exc}", field="model") from None


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
         context_tokens: int = DEFAULT_CONTEXT, update: bool = False) -> ModelFiles:
    """Download (if needed) and verify tower GGUF + head + head config + tokenizer for ``name``.

    ``name`` is ``FAMILY[:QUANT][@SOURCE]``; ``auto`` (or no quant) asks the device policy. A source
    pinned at first pull is checked against main: a moved commit or a changed file raises
    ``PinMismatch`` unless ``update``, which re-pins. A native clef-arch GGUF is split on download.
    """
    cat = catalog or load_catalog()
    ref = cat.parse(name, quant)
    family = cat.family(ref.family)
    if ref.auto:
        _, fitting = _auto_order(family, ref.source, profile, context_tokens, cat)
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
        rec, fitting = _auto_order(family, ref.source, profile, context_tokens, cat)
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

    def to_dict(self) -> dict:
        return {**asdict(self), "path": str(self.path)}


def list_local(*, catalog: Catalog | None = None) -> list[LocalModel]:
    """Tower GGUFs and NVFP4 checkpoints of catalog sources in the HF cache, with size, quant and readiness."""
    cat = catalog or load_catalog()
    if not cache_dir().is_dir():
        return []
    from huggingface_hub import scan_cache_dir

    repos = {r.repo_id: r for r in scan_cache_dir(cache_dir()).repos if r.repo_type == "model"}
    pins = read_pins()
    out = []
    for family in cat.families.values():
        head = family.head_source
        head_repo = repos.get(head.repo)
        # The head files cached at the head source's pinned revision.
        head_cached = {f.file_name for rev in (head_repo.revisions if head_repo else ())
                       if rev.commit_hash == head.revision for f in rev.files}
        head_ready = {head.files[k].file for k in HEAD_KEYS} <= head_cached
        for src in (s for s in family.sources if s.role in ("tower", "native") and s.repo in repos):
            held = src.revision or (pins.get(src.repo) or {}).get("commit")
            by = "catalog" if src.pinned else "first pull" if held else None
            for rev in repos[src.repo].revisions:
                for f in rev.files:
                    quant = _quant_of(src, f.file_name)
                    if quant is None:
                        continue
                    blob = f.blob_path.resolve()
                    checked = stamp(blob)
                    ready = head_ready if src.role == "tower" else _split_is_current(
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


def _local_checkpoints(src: Source, family: Family, repo, pins: dict, head_cached: set[str]) -> list[LocalModel]:
    """One row per cached snapshot of a checkpoint repository that has its config.json."""
    held = src.revision or (pins.get(src.repo) or {}).get("commit")
    by = "catalog" if src.pinned else "first pull" if held else None
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
            name=f"{family.name}:{src.checkpoint.quant}@{src.alias}", family=family.name,
            quant=src.checkpoint.quant, source=src.alias, repo=src.repo, commit=rev.commit_hash,
            pinned=rev.commit_hash == held, source_pinned=held is not None, file=CHECKPOINT_CONFIG,
            path=rev.snapshot_path, size_bytes=sum(f.size_on_disk for f in files.values()), verified=verified,
            head_ready=_checkpoint_ready(src, rev.snapshot_path, set(files), family.head_source, head_cached),
            pinned_by=by, backend="nvfp4"))
    return rows


def _quant_of(src: Source, file_name: str) -> str | None:
    for quant, entry in src.files.items():
        if entry.file == file_name or (entry.file is None and src.file_pattern and
                                       fnmatch.fnmatch(file_name.lower(), src.pattern_for(quant).lower())):
            return quant
    return None


# ---------------------------------------------------------------- CLI: clef-gguf pull / list

def add_pull_arguments(parser) -> None:
    parser.add_argument("name", help="clef-flash, clef-flash:Q4_K_M, clef:Q4_K_M, clef-flash:auto[@SOURCE]; "
                        "NVFP4 checkpoints for the nvfp4 backend: clef-flash:nvfp4a16 (W4A16), "
                        "clef-flash:nvfp4 (W4A4), clef:nvfp4 (27B W4A4)")
    parser.add_argument("--quant", help="quant type (Q4_K_M, ..., NVFP4A16, NVFP4) or 'auto' (overrides :QUANT "
                        "in the name; auto picks among GGUF quants only)")
    parser.add_argument("--ctx", type=positive_int, default=DEFAULT_CONTEXT, help="context the auto choice budgets for")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="print the resulting files as JSON")
    parser.add_argument("--update", action="store_true",
                        help="for a source pinned at its first pull (no revision in the "
                             "catalog): accept that main moved or a file changed, and re-pin; "
                             "without it such a pull is refused (pin_mismatch)")
    parser.epilog = ("A GGUF name pulls one tower file plus the head and tokenizer of the family's release. An "
                     "NVFP4 name (clef-flash:nvfp4a16, clef-flash:nvfp4, clef:nvfp4) pulls the checkpoint "
                     "repository's config, safetensors weights, index, tokenizer and head files into one "
                     "snapshot directory of the Hugging Face cache (the head from the release if the "
                     "repository lacks it), pinned and sha256-checked the same way; `clef-gguf pick` says "
                     "whether this GPU runs it natively.")


def run_pull(args) -> int:
    cat = load_catalog()
    ref = cat.parse(args.name, args.quant)
    family = cat.family(ref.family)
    if ref.auto:
        rec, fitting = _auto_order(family, ref.source, None, args.ctx, cat)
        print(f"auto: {rec.reason}", file=sys.stderr)
        ref = ModelRef(family.name, fitting[0], ref.source)
    src = family.tower_source(ref.quant, ref.source)
    before = None if src.pinned else pin(src.repo)
    if src.pinned and args.update:
        print(f"note: the catalog pins {src.repo} at {src.revision[:10]}; --update changes "
              "nothing there", file=sys.stderr)
    elif not src.pinned and before is None:
        print(f"note: {src.repo} has no pinned revision in the catalog; this first pull pins the "
              f"commit main points to now and each file's sha256 in {pins_path()}, and a later "
              "pull that finds them changed is refused unless --update", file=sys.stderr)
    if src.role == "native":
        print(f"note: {src.repo} holds native clef-arch GGUFs (head inside); the download is "
              "split once into a qwen35 tower + head + tokenizer (a copy of the tower's size)",
              file=sys.stderr)
    if src.checkpoint is not None:
        known = src.checkpoint.known_size()
        size = f" (about {known[0] / 1e9:.1f} GB, {known[1]} size)" if known else ""
        print(f"note: {src.repo} is a compressed-tensors NVFP4 {src.checkpoint.scheme} checkpoint for the "
              f"nvfp4 backend (PyTorch on CUDA); its checkpoint files are downloaded{size}",
              file=sys.stderr)
    files = pull(str(ref), progress=not args.no_progress, catalog=cat, update=args.update)
    after = None if src.pinned else pin(src.repo)
    if before and after and before["commit"] != after["commit"]:
        print(f"re-pinned {src.repo}: {before['commit']} -> {after['commit']}", file=sys.stderr)
    if args.json:
        print(json.dumps({"name": files.name, "revision": files.revision, "backend": files.backend,
                          "sha256": files.sha256, **{k: str(v) for k, v in files.paths().items()}}, indent=2))
    else:
        print(f"{files.name}  ({files.revision})" + ("" if files.backend == "gguf" else f"  backend {files.backend}"))
        for role, path in files.paths().items():
            print(f"  {role:<13} {path}")
    return 0


def add_list_arguments(parser) -> None:
    parser.add_argument("--available", action="store_true",
                        help="list the catalog instead of the cache: every GGUF quant and the NVFP4 checkpoints "
                             "(clef-flash:NVFP4A16, clef-flash:NVFP4, clef:NVFP4; backend nvfp4)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _available(cat: Catalog) -> list[dict]:
    """Every GGUF and NVFP4 checkpoint the catalog can pull, one row per source and quant (best
    quality first; checkpoints after the GGUF quants). A size nobody published is None."""
    pins = read_pins()
    rows = []
    for family in cat.families.values():
        defaults = {q: family.tower_source(q).alias for q in family.quants() + family.checkpoint_quants()}
        for order, src in enumerate(s for s in family.sources if s.quants):
            held = src.revision or (pins.get(src.repo) or {}).get("commit")
            for quant in src.quants:
                known = src.checkpoint.known_size() if src.checkpoint else family.tower_size(quant, src.alias)
                size, basis = known or (None, "unknown")
                by = "catalog" if src.pinned else "first pull" if held else None
                rows.append({"name": f"{family.name}:{quant}@{src.alias}", "family": family.name,
                             "quant": quant, "source": src.alias, "role": src.role, "backend": src.backend,
                             "repo": src.repo, "revision": held, "pinned_by": by,
                             "default": defaults.get(quant) == src.alias,
                             "size_bytes": size, "size_basis": basis, "_order": order})
    families = list(cat.families)
    rows.sort(key=lambda r: (families.index(r["family"]), cat.quality_rank(r["quant"]),
                             r["_order"]))
    return [{k: v for k, v in r.items() if k != "_order"} for r in rows]


def run_list(args) -> int:
    cat = load_catalog()
    if args.available:
        rows = _available(cat)
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        for r in rows:
            rev = ("pinned at first pull" if r["pinned_by"] is None else r["revision"][:10]
                   + (" (first pull)" if r["pinned_by"] == "first pull" else ""))
            size = "     ?" if r["size_bytes"] is None else f"{r['size_bytes'] / 1e9:6.2f}"
            repo = f"  {r['repo']}" if r["backend"] != "gguf" else ""
            print(f"{'*' if r['default'] else ' '} {r['name']:<30} {size} GB "
                  f"({r['size_basis']:<8}) {r['role']:<6} {rev}{repo}")
        print("* = what FAMILY:QUANT without @SOURCE pulls; native files are split on download; nvfp4 rows are "
              "compressed-tensors checkpoint repositories for the nvfp4 backend (PyTorch on CUDA; see `clef-gguf "
              "pick`)")
        return 0
    models = list_local(catalog=cat)
    if args.json:
        print(json.dumps([m.to_dict() for m in models], indent=2))
        return 0
    if not models:
        print(f"no Clef models in the Hugging Face cache ({cache_dir()}); try `clef-gguf pull clef-flash`")
    for m in models:
        towers = {s.alias for s in cat.family(m.family).tower_sources}
        missing = ("incomplete" if m.backend == "nvfp4" else "head missing" if m.source in towers
                   else "not split yet")
        state = (("ready" if m.head_ready else missing) + (", verified" if m.verified else "")
                 + ("" if m.backend == "gguf" else f" ({m.backend} checkpoint)"))
        rev = m.commit[:10] + (" (unpinned source)" if not m.source_pinned
                               else " (not the pinned revision)" if not m.pinned
                               else " (pinned at first pull)" if m.pinned_by == "first pull"
                               else "")
        print(f"{m.name:<32} {m.size_bytes / 1e9:6.2f} GB  {rev:<12} {state}")
    return 0
