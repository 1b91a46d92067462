"""Downloads: one file of a catalog source, at its pinned revision, verified, through huggingface_hub.

Downloads go through ``huggingface_hub.hf_hub_download``, so the files land in the ordinary HF cache
(shared with every other HF tool), tokens and gated repos work as usual, interrupted transfers are
resumed by huggingface_hub, and its tqdm bars show progress. Every file is hash-checked before it is
handed out and a bad one is removed, never used (``hfcache``). A source the catalog does not pin
(``revision: null``) is pinned at its first pull (``pins``). Environment (``HF_HOME``,
``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, ``HF_TOKEN``) is read at call time.
"""

from __future__ import annotations

import fnmatch
import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from clef_gguf.core.errors import ClefError, CorruptModel, ModelNotFound
from clef_gguf.models.catalog import FileEntry, Source
from clef_gguf.models.hfcache import COMMIT_RE, SHA256_RE, cache_dir, endpoint, offline, repo_dir, token, verify
from clef_gguf.models.pins import Pin, changed, pin, pinned_sha, pins_path, record_pin, refuse_moved

# Makes the error for a Hub file that is not the expected one: (the Hub's sha256, its size) -> error.
Mismatch = Callable[[str | None, int | None], ClefError]


class _SilentTqdm:
    """Progress sink for ``progress=False`` (a plain class: huggingface_hub then passes no extra kwargs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass

    def __enter__(self) -> _SilentTqdm:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@contextmanager
def hub_errors(src: Source, revision: str, filename: str) -> Iterator[None]:
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


def download(src: Source, filename: str, revision: str, *, local_only: bool, progress: bool,
             expected_sha: str | None = None, expected_size: int | None = None,
             mismatch: Mismatch | None = None, refresh: bool = False) -> Path:
    """One file of ``src`` at ``revision`` (a commit, or "main" for an unpinned cache), cached.

    ``mismatch(hub_sha, hub_size)`` makes the error for a Hub file that is not the expected one;
    ``refresh`` downloads again although the commit's file is cached (a re-pinned changed file)."""
    if refresh:  # huggingface_hub never re-points an existing snapshot link, even when forced
        (repo_dir(src.repo) / "snapshots" / revision / filename).unlink(missing_ok=True)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"{src.repo}@{revision} / {filename}"
    kwargs: dict[str, Any] = dict(repo_id=src.repo, filename=filename, revision=revision,
                                  cache_dir=str(cache_dir()), endpoint=endpoint(), token=token())
    if not progress and "tqdm_class" in inspect.signature(hf_hub_download).parameters:
        kwargs["tqdm_class"] = _SilentTqdm  # older huggingface_hub has no tqdm_class: bars stay on
    with hub_errors(src, revision, filename):
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


def hub_file(src: Source, filename: str,
             revision: str) -> tuple[str | None, str | None, int | None]:
    """(commit, LFS sha256 or None, size) of a file on the Hub at ``revision``: one HEAD request."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(src.repo, filename, revision=revision, endpoint=endpoint())
    meta = get_hf_file_metadata(url, token=token())
    sha = meta.etag if meta.etag and SHA256_RE.match(meta.etag) else None
    return meta.commit_hash, sha, meta.size


def _precheck(src: Source, filename: str, revision: str, sha: str | None, size: int | None,
              mismatch: Mismatch | None = None) -> None:
    """Before a long download: refuse a Hub file at the pinned commit that is not the expected."""
    if not (sha or size):
        return
    _, hub_sha, hub_size = hub_file(src, filename, revision)
    if (sha and hub_sha and hub_sha != sha) or (size and hub_size and hub_size != size):
        if mismatch is not None:
            raise mismatch(hub_sha, hub_size)
        raise CorruptModel(f"{src.repo}@{revision} / {filename} on the Hub (sha256 {hub_sha}, "
                           f"{hub_size} bytes) is not the catalog's file (sha256 {sha}, {size} "
                           "bytes); not downloading", field="model")


def cached_main(src: Source) -> str | None:
    """The commit main pointed to when huggingface_hub last downloaded ``src`` (pre-pin caches)."""
    ref = repo_dir(src.repo) / "refs" / "main"
    return ref.read_text().strip() if ref.is_file() else None


def _discover(src: Source, quant: str, revision: str | None, *,
              local_only: bool) -> tuple[str, str | None]:
    """(file name, Hub LFS sha256 or None) of a quant whose file name the catalog does not know."""
    pattern = (src.pattern_for(quant) or "").lower()
    listed: dict[str, str | None] = {}
    if local_only:
        commit = revision if revision and COMMIT_RE.match(revision) else cached_main(src)
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
                    lfs = getattr(item, "lfs", None)
                    listed[item.path] = lfs.sha256 if lfs else None
        except (HfHubHTTPError, OSError) as exc:
            raise ModelNotFound(f"cannot list {src.repo} to find its {quant} file: {exc}", field="model") from None
    hits = sorted(n for n in listed if fnmatch.fnmatch(n.rsplit("/", 1)[-1].lower(), pattern)
                  and "mmproj" not in n.lower())
    if len(hits) != 1:
        found = "no file" if not hits else f"several files ({', '.join(hits)})"
        where = "in the cache" if local_only else "on the Hub"
        raise ModelNotFound(f"{src.repo} has {found} matching {pattern} {where}", field="model")
    return hits[0], listed[hits[0]]


def commit_of(path: Path) -> str | None:
    parts = path.parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts else None


def main_commit(src: Source, filename: str, held: Pin | None, *, name: str, update: bool,
                missing: str | None = None) -> tuple[str, str | None]:
    """(the commit main points to now, the Hub's LFS sha256 of ``filename`` there or None): one HEAD
    request. A source pinned at first pull (``held``) whose main moved is refused (``PinMismatch``)
    unless ``update``. ``missing``: the message when ``filename`` is not at main (else the download's)."""
    from huggingface_hub.errors import EntryNotFoundError

    with hub_errors(src, "main", filename):
        try:
            commit, sha, _ = hub_file(src, filename, "main")
        except EntryNotFoundError:
            if missing is None:
                raise
            raise ModelNotFound(missing, field="model") from None
    if not commit:
        raise ModelNotFound(f"{endpoint() or 'the Hub'} did not say which commit {src.repo}'s main is "
                            "(no X-Repo-Commit header), so it cannot be pinned", field="model")
    refuse_moved(src.repo, held, commit, name=name, update=update)
    return commit, sha


def fetch(src: Source, key: str, *, name: str, local_only: bool, progress: bool,
          check_main: bool = False, update: bool = False,
          entry: FileEntry | None = None) -> tuple[Path, str]:
    """(path, sha256) of one verified file of ``src``: ``key`` is a quant or a head role, or, with
    ``entry``, any file (one file of a checkpoint repository).

    ``name`` is the model name a PinMismatch tells the user to pull with --update. ``check_main``
    (pull): for a source pinned at first pull, ask the Hub where main is now and refuse a move;
    without it (resolve), the pinned commit is used as it is."""
    entry = entry or src.entry(key)
    label = f"{src.repo} / {entry.file or key}"
    if src.revision is not None:  # pinned by the catalog
        filename, expected = entry.file, entry.sha256
        if filename is None:
            filename, listed_sha = _discover(src, key, src.revision, local_only=local_only)
            expected = expected or listed_sha
        path = download(src, filename, src.revision, local_only=local_only, progress=progress,
                        expected_sha=expected, expected_size=entry.size)
        return path, verify(path, expected, f"{src.repo} / {filename}")

    held = pin(src.repo)
    if local_only:  # the pinned commit; a cache from before pins existed: what refs/main says
        cached = held["commit"] if held else cached_main(src)
        filename = entry.file or _discover(src, key, cached, local_only=True)[0]
        path = download(src, filename, cached or "main", local_only=True, progress=progress)
        return path, verify(path, pinned_sha(held, filename), label)

    hub_sha: str | None = None
    refresh = False
    if held and not check_main:
        commit: str = held["commit"]
        filename = entry.file or _discover(src, key, commit, local_only=False)[0]
        expected = pinned_sha(held, filename)
    else:  # the first pull, or a pull checking that main is still the pin
        filename = entry.file or _discover(src, key, "main", local_only=False)[0]
        commit, hub_sha = main_commit(src, filename, held, name=name, update=update)
        expected = pinned_sha(held, filename) if held and held["commit"] == commit else None
        if expected and hub_sha and hub_sha != expected:
            if not update:
                raise changed(src.repo, filename, commit, expected, hub_sha, name)
            # Same commit, new bytes (only a rewritten mirror does that): the cached copy is old.
            expected, refresh = None, True
        expected = expected or hub_sha

    def mismatch(now: str | None, _size: int | None) -> ClefError:
        return changed(src.repo, filename, commit, expected, now, name)

    path = download(src, filename, commit, local_only=False, progress=progress,
                    expected_sha=expected, mismatch=mismatch, refresh=refresh)
    sha = verify(path, expected, f"{src.repo} / {filename}")
    record_pin(src.repo, commit, filename, sha, path.stat().st_size, update=update, name=name)
    return path, sha
