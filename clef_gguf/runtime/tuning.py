"""The run settings a model loads with: the ones given, else what ``clef-gguf tune`` measured, else defaults.

``tune`` keeps its winners per machine and tower file (``models/tuned.py``). A tuned value fills a
setting only where the settings leave it to the runtime (``threads``/``decode_chunk``/``pack_size``
None, ``flash_attention``/``head_device`` "auto", ``head_dtype`` not given) and ``tune`` is on: an
explicit flag or keyword always wins, and ``--no-tune`` (``tune=False``) keeps the built-in defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from clef_gguf.core.limits import DECODE_CHUNK
from clef_gguf.models import tuned
from clef_gguf.runtime.settings import LoadSettings

# --flash-attention's value -> the tower's attention setting (a name of tower.llama.ATTENTION; None: the
# weights' rule)
FLASH_ATTENTION: dict[str, str | None] = {"auto": None, "on": "flash-on", "off": "flash-off"}
# What each setting is when the runtime chooses it (a tuned value may fill it then).
UNSET: dict[str, object] = {"threads": None, "decode_chunk": None, "pack_size": None, "flash_attention": "auto",
                            "head_device": "auto"}


@dataclass(frozen=True)
class RunSettings:
    """What the tower and the head run with, and which of it came from ``tune``."""

    threads: int | None
    decode_chunk: int
    attention: str | None
    pack: int | None
    head_device: str
    head_dtype: str
    from_tune: dict[str, tuned.Value] = field(default_factory=dict)  # setting -> the tuned value used


def _open(settings: LoadSettings, name: str, chosen: dict[str, tuned.Value]) -> bool:
    """Whether ``name`` is left to the runtime and ``tune`` chose a value for it."""
    if name not in chosen:
        return False
    if name == "head_dtype":
        return "head_dtype" not in settings.model_fields_set
    return getattr(settings, name) == UNSET[name]


def for_tower(settings: LoadSettings, tower: Path | None, device: str | None) -> RunSettings:
    """The run settings of a llama.cpp ``tower`` file placed on ``device`` ("cpu"/"gpu"): the given
    ones, tune's where none is given (``tower`` None: no tuning applies, as for NVFP4 checkpoints)."""
    kept = tuned.current(tower, device) if settings.tune and tower is not None and device else None
    chosen = kept.chosen if kept is not None else {}
    used = {name: value for name, value in chosen.items() if _open(settings, name, chosen)}
    merged = {name: used.get(name, getattr(settings, name)) for name in tuned.SETTINGS}
    return RunSettings(threads=merged["threads"], decode_chunk=merged["decode_chunk"] or DECODE_CHUNK,
                       attention=FLASH_ATTENTION[str(merged["flash_attention"])], pack=merged["pack_size"],
                       head_device=str(merged["head_device"]), head_dtype=str(merged["head_dtype"]), from_tune=used)
