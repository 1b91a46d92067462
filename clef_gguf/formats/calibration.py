"""CAL.json: temperatures per question type and option-count band, bound to the weights they were
fitted on. The runtime divides each question's logits by its temperature before the softmax.

    {"format": "clef-gguf-calibration/1", "version": "cal-<16 hex>",
     "bound_to": {"tower_sha256", "head_sha256", "head_config_sha256", "prompt_template_sha256",
                  "adapter_sha256"},
     "temperatures": {"choice": {"temperature", "source", "n"}, "choice.3_5": {...}, ...},
     "fit": {...what it was fitted on and the held-out report...}}

Keys follow upstream llama.cpp's GGUF metadata ``<arch>.decision.temperature.<type>[.<bucket>]``
with buckets ``2``, ``3_5``, ``6_10``, ``11``: a question looks up ``<type>.<bucket>``, then
``<type>``, then uses 1.0. The version is a digest of everything else in the file, so a file
edited after the fit no longer matches its version and is refused (immutable), and the
response's ``audit.calibration_version`` names exactly what was applied.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_gguf.core import errors
from clef_gguf.formats.files import ModelFiles
from clef_gguf.core.questions import QUESTION_TYPES

CALIBRATION_FORMAT = "clef-gguf-calibration/1"
NONE = "none"  # audit.calibration_version without a calibration: the reference's T = 1
BANDS = ((2, "2"), (5, "3_5"), (10, "6_10"), (math.inf, "11"))  # (largest option count, name)
BOUND_KEYS = ("tower_sha256", "head_sha256", "head_config_sha256", "prompt_template_sha256",
              "adapter_sha256")
T_RANGE = (0.05, 20.0)  # what a file may hold; the fit's own bounds are narrower (fit.BOUNDS)


def band(n_options: int) -> str:
    return next(name for top, name in BANDS if n_options <= top)


def key(question_type: str, n_options: int) -> str:
    return f"{question_type}.{band(n_options)}"


def version_of(body: dict[str, Any]) -> str:
    """``cal-`` + 16 hex digits of the canonical JSON of every field but ``version``."""
    canonical = json.dumps({k: v for k, v in body.items() if k != "version"}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return "cal-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def binding(files: ModelFiles, model_hash: str, template_sha256: str) -> dict[str, str | None]:
    """What a calibration is bound to: the weights and template that produce the logits."""
    return {"tower_sha256": model_hash, "head_sha256": files.sha256_of(files.head_weights),
            "head_config_sha256": files.sha256_of(files.head_config),
            "prompt_template_sha256": template_sha256, "adapter_sha256": None}


@dataclass(frozen=True)
class Calibration:
    version: str
    temperatures: dict[str, float]  # "<type>" or "<type>.<band>" -> T
    body: dict[str, Any]  # the whole file, as read or as it will be written

    @classmethod
    def build(cls, body: dict[str, Any]) -> Calibration:
        """A new calibration from its fields (``version`` is computed)."""
        body = {"format": CALIBRATION_FORMAT, **{k: v for k, v in body.items() if k not in ("format", "version")}}
        body["version"] = version_of(body)
        return cls.parse(body, source="the new calibration")

    @classmethod
    def parse(cls, body: Any, source: str = "the calibration file") -> Calibration:
        def bad(why: str) -> errors.CorruptCalibration:
            return errors.CorruptCalibration(f"{source}: {why}", field="calibration")

        if not isinstance(body, dict) or body.get("format") != CALIBRATION_FORMAT:
            raise bad(f"not a clef-gguf calibration file (format {CALIBRATION_FORMAT})")
        version = body.get("version")
        try:
            expected = version_of(body)
        except (TypeError, ValueError) as exc:
            raise bad(f"cannot be read: {exc}") from None
        if version != expected:
            raise bad(f"its content does not match its version {version!r:.40} (edited after it "
                      "was fitted?): fit it again with clef-gguf calibrate")
        bound = body.get("bound_to")
        if not isinstance(bound, dict) or set(bound) != set(BOUND_KEYS):
            raise bad(f"bound_to must name {', '.join(BOUND_KEYS)}")
        table = body.get("temperatures")
        if not isinstance(table, dict):
            raise bad("temperatures must be an object")
        temperatures: dict[str, float] = {}
        for name, entry in table.items():
            t = entry.get("temperature") if isinstance(entry, dict) else None
            qtype = name.split(".", 1)[0]
            if qtype not in QUESTION_TYPES or (isinstance(t, bool) or not isinstance(t, (int, float))
                                               or not T_RANGE[0] <= t <= T_RANGE[1]):
                raise bad(f"temperatures.{name}: a temperature in {T_RANGE[0]}..{T_RANGE[1]} "
                          "for a noul, choice or score key")
            temperatures[name] = float(t)
        return cls(str(version), temperatures, body)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise errors.CorruptCalibration(f"cannot read the calibration file: {exc.strerror}: "
                                            f"{path}", field="calibration") from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise errors.CorruptCalibration(f"{path} is not JSON: {exc}", field="calibration") \
                from None
        return cls.parse(body, source=str(path))

    @property
    def is_identity(self) -> bool:
        """Whether this is ``IDENTITY``: the reference's probabilities (no file was given)."""
        return self.version == NONE

    def temperature(self, question_type: str, n_options: int) -> float:
        t = self.temperatures
        return t.get(key(question_type, n_options), t.get(question_type, 1.0))

    def temperatures_for(self, types: Sequence[int], counts: Sequence[int]) -> tuple[float, ...]:
        """One temperature per question of an encoded prompt (type indices, option counts)."""
        return tuple(self.temperature(QUESTION_TYPES[t], n) for t, n in zip(types, counts))

    def check_bound(self, actual: dict[str, str | None]) -> None:
        """Refuse a calibration fitted on other weights, head or template than ``actual``."""
        bound = self.body["bound_to"]
        wrong = [k for k in BOUND_KEYS if bound.get(k) != actual.get(k)]
        if wrong:
            raise errors.CalibrationMismatch(
                f"calibration {self.version} was fitted on other files than this model "
                f"({', '.join(wrong)} differ): fit one for this model with clef-gguf calibrate",
                field="calibration")

    def check_requested(self, asked: Any) -> None:
        """A request's ``calibration``: absent or this version, else refused (it would get other
        probabilities than it asked for, silently). Uncalibrated, the key is ignored (with a warning,
        by the parser), as the reference ignores it."""
        if self.is_identity or asked is None or (isinstance(asked, str) and asked == self.version):
            return
        wanted = ("no calibration (\"none\")" if asked == NONE else
                  f"calibration {json.dumps(asked, default=repr)[:60]}")
        raise errors.WrongCalibration(
            f"the request asks for {wanted} but this model applies calibration {self.version}: "
            f"send \"calibration\": \"{self.version}\" or leave it out, or load the model with the "
            "calibration asked for", field="calibration")

    def write(self, path: str | Path) -> Path:
        """Write the file; an existing file is never replaced (a version names one content)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.body, indent=2, sort_keys=True, allow_nan=False) + "\n",
                       encoding="utf-8")
        try:
            os.link(tmp, path)  # whole or not at all, and never over an existing file
        except FileExistsError:
            raise errors.InvalidValue(f"{path} exists: a calibration file is never overwritten, "
                                      "give another --output", field="output") from None
        finally:
            tmp.unlink()
        return path


# What an uncalibrated model applies: T = 1 everywhere, the reference's probabilities.
IDENTITY = Calibration(NONE, {}, {})


def load(value: str | Path | Calibration | None) -> Calibration:
    """``Clef.load(calibration=)``: a path, a Calibration, or None / "none": ``IDENTITY``."""
    if isinstance(value, Calibration):
        return value
    if value is None or str(value) == NONE:
        return IDENTITY
    return Calibration.load(value)
