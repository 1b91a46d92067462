"""The run settings ``clef-gguf tune`` measured for one model on this machine, kept and read back.

``tune`` (``clef_gguf/tools/tune.py``) times each setting against its default side by side and keeps
what won in ``$HF_HOME/clef-gguf/tuned-settings.json``, beside pick's speed table: one entry per tower
file and device ("cpu"/"gpu"), with the machine's fingerprint (CPU, cores, llama.cpp build: the speed
table's ``machine.fingerprint``; on a GPU its name too). The runtime reads it here, below ``runtime``, at
every load (``runtime/tuning.py``); an entry measured on another machine or llama.cpp build is stale
and not used until ``tune`` runs again.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from filelock import FileLock, Timeout

from clef_gguf.core.errors import CacheNotWritable, InvalidSetting
from clef_gguf.models import machine
from clef_gguf.models.hfcache import clef_home, replace_json

# The file's version: raised when what an entry means changes, so that entries an older clef-gguf kept
# (version 1 kept winners measured under load) are ignored rather than applied.
TUNED_FORMAT = "clef-gguf-tuned/2"
Value = Union[int, str]
# The settings tune measures, in the order it measures them (LoadSettings' field names).
SETTINGS = ("threads", "decode_chunk", "flash_attention", "pack_size", "head_device", "head_dtype")
Device = Literal["cpu", "gpu"]


@dataclass(frozen=True)
class Trial:
    """One value of a setting timed against the setting's default at each length, side by side."""

    setting: str
    value: Value
    lengths: tuple[int, ...]
    speedups: tuple[float, ...]  # per length: the default's median time / this value's (> 1: faster)
    spreads: tuple[tuple[float, float], ...]  # per length: the lowest and highest per-round ratio
    max_dp: float | None  # the largest |dp| of its answers against the default's (None: it could not run)
    bar: float  # the parity bar it was held to: 0.0 is byte-identical
    won: bool  # faster at every length within the bar (chosen only when the run was not under load)
    reason: str
    load: dict[str, float] | None = None  # other processes while it was timed (``core.load.Window``)
    loaded: bool = False  # other processes contended for the measured cores meanwhile


@dataclass(frozen=True)
class Tuning:
    """What ``tune`` chose for one tower file on one device of one machine, and why."""

    model: str  # the tower file, resolved
    device: Device
    machine: str  # the fingerprint's hash (``machine_hash``)
    defaults: dict[str, Value]  # every setting's default here
    chosen: dict[str, Value]  # the settings that replace their default (the winners)
    trials: tuple[Trial, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)  # setting -> why it was not measured
    lengths: tuple[int, ...] = ()
    rounds: int = 0
    measured_at: str = ""
    took_seconds: float = 0.0
    loaded: bool = False  # some value was timed under load: nothing chosen, nothing kept (``tools.tune``)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tuning:
        trials = tuple(Trial(**{**t, "lengths": tuple(t["lengths"]), "speedups": tuple(t["speedups"]),
                                "spreads": tuple(tuple(s) for s in t["spreads"])}) for t in d["trials"])
        return cls(**{**d, "trials": trials, "lengths": tuple(d["lengths"])})


def cache_path() -> Path:
    return clef_home() / "tuned-settings.json"


def machine_hash(device: str, gpu_names: tuple[str, ...] = ()) -> str:
    """The fingerprint a tuning is valid for: this machine and llama.cpp build (and, on a GPU, its name)."""
    parts = {"format": TUNED_FORMAT, **machine.fingerprint(), "device": device,
             "gpus": list(gpu_names) if device == "gpu" else []}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def gpu_names() -> tuple[str, ...]:
    return tuple(g.name for g in machine.probe(check_llama=False).gpus)


def entry_key(tower: Path, device: str) -> str:
    """One entry per tower file (its resolved path and size) and device."""
    path = Path(tower).resolve()
    return f"{path}|{path.stat().st_size}|{device}"


def _read() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data.get("entries", {}) if isinstance(data, dict) and data.get("format") == TUNED_FORMAT else {}


def kept(tower: Path, device: str) -> Tuning | None:
    """The tuning kept for ``tower`` on ``device``, whatever machine measured it (None: none, or unreadable)."""
    found = _read().get(entry_key(tower, device))
    try:
        return Tuning.from_dict(found) if isinstance(found, dict) else None
    except (TypeError, KeyError):
        return None


def current(tower: Path, device: str) -> Tuning | None:
    """The kept tuning when it was measured on this machine and llama.cpp build, else None (stale)."""
    found = kept(tower, device)
    if found is None:
        return None
    return found if found.machine == machine_hash(device, gpu_names() if device == "gpu" else ()) else None


def store(tuning: Tuning) -> Path:
    """Keep ``tuning`` (replacing the entry of the same tower and device) and say where; a home that
    cannot be written, or a run under load, is refused: nothing is kept, and the caller says so."""
    if tuning.loaded:
        raise InvalidSetting("a tuning measured under load is not kept: its ratios measure the other "
                             "processes too", field="tuning")
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=60):
            entries = _read()
            entries[entry_key(Path(tuning.model), tuning.device)] = tuning.to_dict()
            replace_json(path, {"format": TUNED_FORMAT, "entries": entries})
    except Timeout:
        raise CacheNotWritable(f"{path} stayed locked by another process for 60 s: nothing was kept",
                               field="HF_HOME") from None
    except OSError as exc:
        raise CacheNotWritable(f"cannot write {path}: {exc.strerror or exc}: nothing was kept (set HF_HOME "
                               "to a folder this user can write)", field="HF_HOME") from None
    return path


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
