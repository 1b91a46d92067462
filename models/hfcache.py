"""The Hugging Face cache as clef-gguf sees it: environment read at call time, and hash verification.

huggingface_hub reads ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_ENDPOINT`` once, at
import; these helpers read them whenever they are called, so a test (or a long-lived server) that
changes them is obeyed.

Verification: a file is checked against the catalog's sha256 where it knows one, else against the
Hub's LFS sha256, which is the cache blob's name. A mismatch deletes the snapshot link and the blob
(the next pull downloads it afresh) and raises ``CorruptModel``. Hashing a 6 GB tower takes seconds,
so a checked blob is stamped (path, size, mtime_ns -> sha256) in ``$HF_HOME/clef-gguf/verified.json``
and re-hashed only when it changes.

Pins: a source whose catalog entry has no revision (a community repo that publishes none) is pinned
at its first pull: the commit main pointed to and each pulled file's sha256 go to
``$HF_HOME/clef-gguf/pins.json``. Later downloads use that commit and those hashes; a pull that
finds main moved or a file changed raises ``PinMismatch`` until ``clef-gguf pull --update``
re-pins.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock, Timeout

from clef_gguf.errors import CorruptModel, ModelLoadError
from clef_gguf.files import sha256_file

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
PINS_FORMAT = "clef-gguf-pins/1"
LOCK_TIMEOUT_S = 60


class PinMismatch(ModelLoadError):
    """The Hub no longer serves what a source's first pull pinned: main moved, or a file changed."""

    code = "pin_mismatch"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline() -> bool:
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))


def hf_home() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(os.path.expandvars(os.path.expanduser(os.environ.get("HF_HOME") or str(default))))


def cache_dir() -> Path:
    """The HF hub cache, as huggingface_hub would compute it now."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return Path(os.path.expandvars(os.path.expanduser(explicit))) if explicit else hf_home() / "hub"


def endpoint() -> str | None:
    return (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None


def token() -> str | None:
    return os.environ.get("HF_TOKEN") or None  # None: huggingface_hub falls back to the saved login


def repo_dir(repo: str) -> Path:
    return cache_dir() / ("models--" + repo.replace("/", "--"))


def clef_home() -> Path:
    """clef-gguf's own state beside the HF cache: verification stamps, pins, split models."""
    return hf_home() / "clef-gguf"


def split_dir(repo: str, commit: str, quant: str) -> Path:
    """Where a native clef-arch GGUF of ``repo`` at ``commit`` is split into a model directory."""
    return clef_home() / "split" / f"{repo.replace('/', '--')}@{commit}" / quant


def _stamps_path() -> Path:
    return clef_home() / "verified.json"


def _read_stamps() -> dict:
    try:
        return json.loads(_stamps_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_stamp(blob: Path, sha: str | None, checked: bool = False) -> None:
    """Record (or with ``sha=None`` forget) a blob's hash.

    Read-modify-write under a file lock: concurrent ``pull`` / ``serve`` processes stamping other
    blobs must not drop each other's entries. The replace is atomic, so readers need no lock."""
    path = _stamps_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=60):
            stamps = _read_stamps()
            if sha is None:
                if stamps.pop(str(blob), None) is None:
                    return
            else:
                st = blob.stat()
                stamps[str(blob)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha,
                                     "checked": checked}
            _replace_json(path, stamps)
    except (OSError, Timeout):  # a read-only HF_HOME or a stuck lock: verify again next time
        pass


def _replace_json(path: Path, data: dict) -> None:
    # Write beside and rename: a reader sees the old file or the new one, never half of one.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def stamp(blob: Path) -> dict | None:
    """The stamp of an unchanged blob: {"sha256", "checked" (matched a reference hash), ...}, else None."""
    entry = _read_stamps().get(str(blob))
    try:
        st = blob.stat()
    except OSError:
        return None
    if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return entry
    return None


def verify(path: Path, expected: str | None, label: str) -> str:
    """sha256 of a cached file, checked against ``expected`` or the Hub's LFS sha256 (the blob name)."""
    blob = path.resolve()
    want = expected or (blob.name if SHA256_RE.match(blob.name) else None)
    known = stamp(blob)
    actual = known["sha256"] if known else sha256_file(blob)
    if want and actual != want:
        for p in {path, blob}:  # the snapshot link and its blob: the next pull downloads it afresh
            p.unlink(missing_ok=True)
        _drop_stamp(blob)
        raise CorruptModel(f"sha256 mismatch for {label}: expected {want}, got {actual}. The file was "
                           f"removed from the cache ({path}); run the pull again.", field="model")
    if not known or (want and not known.get("checked")):
        _write_stamp(blob, actual, checked=want is not None)
    return actual


def _drop_stamp(blob: Path) -> None:
    _write_stamp(blob, None)


# ---------------------------------------------------------------- pins of first pulls

def pins_path() -> Path:
    return clef_home() / "pins.json"


def read_pins() -> dict[str, dict]:
    """repo -> {"commit", "pinned_at", "files": {name: {"sha256", "size"}}}; {} before any pin.

    An unreadable pins file is an error, not an empty one: forgetting the pins silently would
    accept whatever the Hub serves next."""
    path = pins_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the pins of first pulls ({path}): {exc}. Fix the "
                             "file, or delete it to pin again at the next pull",
                             field="model") from None
    if not (isinstance(data, dict) and data.get("format") == PINS_FORMAT
            and isinstance(data.get("repos"), dict)):
        raise ModelLoadError(f"{path} is not a {PINS_FORMAT} file. Fix it, or delete it to pin "
                             "again at the next pull", field="model")
    return data["repos"]


def pin(repo: str) -> dict | None:
    return read_pins().get(repo)


def pinned_sha(entry: dict | None, filename: str) -> str | None:
    return ((entry or {}).get("files", {}).get(filename) or {}).get("sha256")


def moved_message(repo: str, entry: dict, commit: str, name: str) -> str:
    return (f"{repo} has moved since its first pull: main is now commit {commit}, but clef-gguf "
            f"pinned {entry['commit']} on {entry.get('pinned_at', '?')} ({pins_path()}). Nothing "
            "was downloaded; what was pulled at the pin keeps working (decide and serve use the "
            f"pinned commit). To accept the new revision: clef-gguf pull {name} --update")


def changed_message(repo: str, filename: str, commit: str, pinned: str, now: str | None,
                    name: str) -> str:
    return (f"{repo} / {filename} at commit {commit} is now sha256 {now or 'unknown'}, but its "
            f"first pull pinned sha256 {pinned} ({pins_path()}); not using it. To accept the new "
            f"file: clef-gguf pull {name} --update")


def record_pin(repo: str, commit: str, filename: str, sha: str, size: int, *, update: bool,
               name: str) -> dict:
    """Hold ``repo`` at ``commit`` and ``filename`` at ``sha``; returns the repo's pin.

    Check-and-set under a file lock, atomically replaced: two first pulls of one repo that saw
    main at different commits cannot both win, and one refuses with ``PinMismatch``. With
    ``update`` a different commit replaces the pin (its file hashes belong to the old commit).
    Unlike a stamp, a pin that cannot be written is an error: the pull would protect nothing."""
    path = pins_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
            repos = read_pins()
            entry = repos.get(repo)
            if entry is not None and entry.get("commit") != commit:
                if not update:
                    raise PinMismatch(moved_message(repo, entry, commit, name), field="model")
                entry = None
            if entry is None:
                entry = {"commit": commit, "files": {},
                         "pinned_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            held = pinned_sha(entry, filename)
            if held and held != sha and not update:
                raise PinMismatch(changed_message(repo, filename, commit, held, sha, name),
                                  field="model")
            entry["files"][filename] = {"sha256": sha, "size": size}
            repos[repo] = entry
            _replace_json(path, {"format": PINS_FORMAT, "repos": repos})
            return entry
    except Timeout:
        raise ModelLoadError(f"{path}.lock stayed locked for {LOCK_TIMEOUT_S} s (another pull?); "
                             "try again", field="model") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot record the pin of {repo} in {path}: {exc}",
                             field="model") from None
