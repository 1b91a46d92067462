"""Pins of first pulls: what a source without a catalog revision is held to, in ``pins.json``.

A source whose catalog entry has no revision (a community repo that publishes none) is pinned at its
first pull: the commit main pointed to and each pulled file's sha256 go to
``$HF_HOME/clef-gguf/pins.json``. Later downloads use that commit and those hashes; a pull that finds
main moved or a file changed raises ``PinMismatch`` until ``clef-gguf pull --update`` re-pins.
This module reads and writes that file and says when a pin refuses; it asks the Hub nothing.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from clef_gguf.core.errors import ModelLoadError, PinMismatch
from clef_gguf.models.catalog import Source
from clef_gguf.models.hfcache import clef_home, replace_json

PINS_FORMAT = "clef-gguf-pins/1"
LOCK_TIMEOUT_S = 60

# repo -> {"commit", "pinned_at", "files": {name: {"sha256", "size"}}}
Pin = dict[str, Any]


def pins_path() -> Path:
    return clef_home() / "pins.json"


def read_pins() -> dict[str, Pin]:
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
    repos: dict[str, Pin] = data["repos"]
    return repos


def pin(repo: str) -> Pin | None:
    return read_pins().get(repo)


def pinned_sha(entry: Pin | None, filename: str) -> str | None:
    sha: str | None = ((entry or {}).get("files", {}).get(filename) or {}).get("sha256")
    return sha


def held_revision(src: Source, pins: dict[str, Pin]) -> tuple[str | None, str | None]:
    """(the commit ``src`` is held at, who pinned it: "catalog", "first pull", or None when nothing
    is pinned yet)."""
    commit: str | None = src.revision or (pins.get(src.repo) or {}).get("commit")
    return commit, "catalog" if src.pinned else "first pull" if commit else None


def refuse_moved(repo: str, entry: Pin | None, commit: str, *, name: str, update: bool) -> None:
    """Raise ``PinMismatch`` if ``repo`` is pinned (``entry``) at another commit than ``commit``, the
    one main points to now, and the pull does not ``update`` the pin."""
    if entry is not None and entry.get("commit") != commit and not update:
        raise PinMismatch(
            f"{repo} has moved since its first pull: main is now commit {commit}, but clef-gguf "
            f"pinned {entry['commit']} on {entry.get('pinned_at', '?')} ({pins_path()}). Nothing "
            "was downloaded; what was pulled at the pin keeps working (decide and serve use the "
            f"pinned commit). To accept the new revision: clef-gguf pull {name} --update", field="model")


def changed(repo: str, filename: str, commit: str, pinned: str | None, now: str | None,
            name: str) -> PinMismatch:
    """The error for a file at the pinned commit whose sha256 is no longer the pinned one."""
    return PinMismatch(f"{repo} / {filename} at commit {commit} is now sha256 {now or 'unknown'}, but its "
                       f"first pull pinned sha256 {pinned} ({pins_path()}); not using it. To accept the new "
                       f"file: clef-gguf pull {name} --update", field="model")


def record_pin(repo: str, commit: str, filename: str, sha: str, size: int, *, update: bool,
               name: str) -> Pin:
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
            refuse_moved(repo, entry, commit, name=name, update=update)
            if entry is None or entry.get("commit") != commit:
                entry = {"commit": commit, "files": {},
                         "pinned_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            before = pinned_sha(entry, filename)
            if before and before != sha and not update:
                raise changed(repo, filename, commit, before, sha, name)
            entry["files"][filename] = {"sha256": sha, "size": size}
            repos[repo] = entry
            replace_json(path, {"format": PINS_FORMAT, "repos": repos})
            return entry
    except Timeout:
        raise ModelLoadError(f"{path}.lock stayed locked for {LOCK_TIMEOUT_S} s (another pull?); "
                             "try again", field="model") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot record the pin of {repo} in {path}: {exc}",
                             field="model") from None
