"""The opt-in ``"evidence"`` request key: where the head looked in the state, with every answer.

``parse_evidence`` reads it into an ``EvidenceSpec``; ``evidence_spans`` turns the head's attention into
spans of the state; the runtime runs it (``runtime/evidence.py``). What it means: docs/evidence.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clef_gguf.core import errors

MODES = ("attention", "occlusion")
DEFAULT_TOP = 3
MAX_TOP = 32
# The keys of the object form and what each must be.
KEYS = {"top": f"a whole number from 1 to {MAX_TOP}", "mode": " or ".join(MODES),
        "options": "true or false", "grid": "true or false"}


@dataclass(frozen=True)
class EvidenceSpec:
    """What ``"evidence"`` asked for."""

    top: int = DEFAULT_TOP
    mode: str = "attention"
    options: bool = False  # every option's spans too, not only the chosen one's
    grid: bool = False  # each picture's patch grid as a heat map


def parse_evidence(value: Any, field: str = "evidence") -> EvidenceSpec | None:
    """``true``/``false``/``null`` or ``{"top", "mode", "options", "grid"}``; anything else is an
    ``InvalidValue`` naming the field."""
    if value is None or value is False:
        return None
    if value is True:
        return EvidenceSpec()
    if not isinstance(value, dict):
        raise errors.InvalidValue(f"'{field}' must be true, false or an object with {', '.join(KEYS)} "
                                  f"(got {type(value).__name__})", field=field)
    for key in value:
        if key not in KEYS:
            raise errors.InvalidValue(f"'{field}' has no key {key!r}; its keys are {', '.join(KEYS)}",
                                      field=f"{field}.{key}")
    top = value.get("top", DEFAULT_TOP)
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= MAX_TOP:
        raise errors.InvalidValue(f"'{field}.top' must be {KEYS['top']} (got {top!r})", field=f"{field}.top")
    mode = value.get("mode", "attention")
    if mode not in MODES:
        raise errors.InvalidValue(f"'{field}.mode' must be {KEYS['mode']} (got {mode!r})", field=f"{field}.mode")
    flags = {}
    for key in ("options", "grid"):
        flags[key] = value.get(key, False)
        if not isinstance(flags[key], bool):
            raise errors.InvalidValue(f"'{field}.{key}' must be true or false (got {flags[key]!r})",
                                      field=f"{field}.{key}")
    return EvidenceSpec(top, mode, **flags)


def with_evidence(request: Any, evidence: bool | dict[str, Any] | None) -> Any:
    """``request`` with its ``"evidence"`` key set from Python's ``decide(evidence=)`` (None: as it
    is); a request that is not an object is left for the parser to refuse."""
    if evidence is not None and isinstance(request, dict):
        return {**request, "evidence": evidence}
    return request
