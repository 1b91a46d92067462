"""Seconds per decision with each quant on this machine, measured before any download.

``clef-gguf pick`` asks how long one decision of ``--tokens`` prompt tokens takes with each quant the
family publishes. For each, ``convert/probe_tower.py`` writes one full-attention interval of decoder
layers (Clef-Flash: 3 linear-attention + 1 full-attention, hidden 4096, feed-forward 12,288, its head
counts; a small test shape: all its layers) whose tensors have the types the published file gives
them, and ``clef_gguf/pick/speed_run.py`` times prefills through it with the runtime's llama.cpp context and
threads: at the decision's length when that is cheap, else 16 and 64 tokens long. A prefill's time is
a part per ``llama_decode`` call and a part per token (``speed_run._time_tower``); the line through the
fastest of each length gives both, and the prediction adds up a decision's calls and tokens, scales it
to the family's layer count and adds the joint head, timed at the family's shape (and the vision
tower, with a picture):

    per_token = (t64 - t16) / 48    per_call = t16 - 16 x per_token
    tower = (calls x per_call + tokens x per_token) x layers / probe layers    decision = tower + head

A timed prefill is the runtime's tower stage (``Tower.forward``): the system prefix is decoded once
and kept, and each decision restores it and decodes the rest of ``--tokens`` (the probe keeps 4 tokens
of the release's 36: the rest's time does not depend on them, ``speed_run.PREFIX``).

Encoding, lexical rows and the answer are under a millisecond each (BENCHMARKS.md) and are left out.
The results are kept per machine, llama.cpp build, thread count, GPU placement and token count in
``$HF_HOME/clef-gguf/speed-probe.json``: the next ``pick`` reads them (``--reprobe`` measures again).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clef_gguf.convert.synthetic.big import needed_bytes
from clef_gguf.convert.synthetic.shapes import preset_config, preset_for
from clef_gguf.core.errors import InvalidValue, ProbeFailed
from clef_gguf.core.limits import DECODE_CHUNK, SYSTEM_PREFIX_TOKENS, GiB
from clef_gguf.models import machine
from clef_gguf.models.hfcache import clef_home
from clef_gguf.models.placement import Recommendation
from clef_gguf.core import load
from clef_gguf.pick import outliers, probe_process

# The speed table's version: raised when what a table holds changes meaning, so that a table kept by
# an older clef-gguf is measured again rather than misread.
SPEED_TABLE_FORMAT = "clef-gguf-speed-probe/4"
DEFAULT_TOKENS = 500
PREFERENCES = ("quality", "speed")
# Published files that are another type's mix with token_embd and output at Q8_0 (bartowski's "_L"
# and "_XL"): the probe never multiplies by those two matrices, so they time as their base type.
SAME_LAYERS = {"Q6_K_L": "Q6_K", "Q5_K_L": "Q5_K_M", "Q4_K_L": "Q4_K_M", "Q3_K_XL": "Q3_K_L", "Q2_K_L": "Q2_K"}
# A tower whose bf16 file is under this is probed whole: no layer to choose or scale. A few layers of a
# small tower fit the CPU's cache where the whole tower does not, so scaling them up would under-predict it.
WHOLE_TOWER_BYTES = GiB
SCRATCH_BYTES = 4 * GiB  # /dev/shm must have this free to hold the probe's files
TIMEOUT_S = 900  # the whole probe; one quant's hang must not hang pick


@dataclass(frozen=True)
class QuantSpeed:
    """One quant's probe and prediction; ``error`` instead when its probe failed."""

    quant: str
    probe_tokens: int | None = None  # the timed prefills' length (speed_run._time_tower chooses it)
    probe_runs: tuple[float, ...] = ()  # seconds of each, through the probe's layers
    probe_seconds: float | None = None  # the decision's time through the probe's layers (tower_seconds)
    tower_seconds: float | None = None
    seconds: float | None = None  # the whole decision: tower + head
    tokens_per_second: float | None = None  # prompt tokens through the whole tower
    error: str | None = None
    short_tokens: int | None = None  # the line's short end (None: the runs are scaled, or the decision's own)
    short_runs: tuple[float, ...] = ()
    load: dict[str, float] | None = None  # other processes while it was timed (``core.load.Window``)
    loaded: bool = False  # timed under load (and, when measured again, under load again)
    remeasured: bool = False  # measured twice: under load, or out of line with its kernel group


@dataclass(frozen=True)
class SpeedTable:
    family: str
    preset: str
    tokens: int
    threads: int
    gpu_layers: dict[str, int]  # per quant: -1 on the GPU (as the runtime would place it), 0 on the CPU
    layers: int  # the family's decoder layers
    probe_layers: int
    head_seconds: float
    quants: dict[str, QuantSpeed]
    key: str
    measured_at: str
    took_seconds: float
    picture: int | None = None  # the side of the one square picture each decision carries (pick --picture)
    picture_tokens: int = 0  # the prompt tokens it adds (in ``tokens``' place: text + picture)
    picture_seconds: float = 0.0  # the vision tower on it, in every quant's ``seconds``
    cached: bool = False

    @property
    def loaded_quants(self) -> tuple[str, ...]:
        """Quants whose kept time was measured while other processes loaded the probe's cores."""
        return tuple(q for q, s in self.quants.items() if s.loaded)

    def decision(self) -> str:
        """What was timed, in words: "a decision of 500 tokens" (and its picture)."""
        if not self.picture:
            return f"a decision of {self.tokens} tokens"
        return (f"a decision of {self.tokens} text tokens and one {self.picture}x{self.picture} picture "
                f"({self.picture_tokens} more tokens, {self.picture_seconds:.1f} s in the vision tower)")

    def get(self, quant: str) -> QuantSpeed | None:
        return self.quants.get(quant.upper())

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["quants"] = {q: dataclasses.asdict(s) for q, s in self.quants.items()}
        d["loaded_quants"] = list(self.loaded_quants)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeedTable:
        quants = {q: QuantSpeed(**{**s, "probe_runs": tuple(s["probe_runs"]),
                                     "short_runs": tuple(s.get("short_runs", ()))}) for q, s in d["quants"].items()}
        d = {k: v for k, v in d.items() if k != "loaded_quants"}
        return cls(**{**d, "quants": quants})


def probe_layers(p: dict) -> int:
    """The probe's layers for ``convert.synthetic.big`` shape ``p``: all of them when its bf16 tower is under
    ``WHOLE_TOWER_BYTES``, else one full-attention interval (Clef-Flash: 4 of 32)."""
    return p["layers"] if needed_bytes(p, "bf16") <= WHOLE_TOWER_BYTES else p["interval"]


def machine_key(preset: str, tokens: int, threads: int, gpu_layers: dict[str, int], picture: int | None = None) -> str:
    """What the measurement depends on, hashed: CPU, llama.cpp build, threads, placement, tokens, picture."""
    parts = {"format": SPEED_TABLE_FORMAT, **machine.fingerprint(), "preset": preset, "tokens": tokens,
             "threads": threads, "gpu_layers": sorted((q, n) for q, n in gpu_layers.items() if n), "picture": picture}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def cache_path() -> Path:
    return clef_home() / "speed-probe.json"


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("format") == SPEED_TABLE_FORMAT else {}


def _write_cache(table: SpeedTable) -> None:
    data = _read_cache() or {"format": SPEED_TABLE_FORMAT, "tables": {}}
    data.setdefault("tables", {})[table.key] = table.to_dict() | {"cached": False}
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the next pick measures again


def cached(key: str) -> SpeedTable | None:
    found = _read_cache().get("tables", {}).get(key)
    if not isinstance(found, dict):
        return None
    try:
        return dataclasses.replace(SpeedTable.from_dict(found), cached=True)
    except (TypeError, KeyError):
        return None


def _scratch() -> str | None:
    """Where the probe writes its files (up to ~1.7 GB each, deleted after): memory (``/dev/shm``) when it
    has room, so that writing them costs no disk; else the default temporary directory."""
    try:
        if shutil.disk_usage("/dev/shm").free > SCRATCH_BYTES:
            return "/dev/shm"
    except OSError:
        pass
    return None


def decode_calls(tokens: int) -> int:
    """``llama_decode`` calls of a decision that decodes ``tokens`` past the kept prefix: its state and
    its rest apart (``tower/schedule.py``; the probe takes half each), each in chunks of DECODE_CHUNK."""
    half = tokens // 2
    return sum(-(-part // DECODE_CHUNK) for part in (half, tokens - half) if part)


def tower_seconds(n: int, runs: tuple[float, ...], short_n: int | None, shorts: tuple[float, ...],
                  tokens: int) -> float:
    """Seconds of a decision of ``tokens`` past the kept prefix through the probe's layers, from
    ``runs`` of ``n`` tokens (and ``shorts`` of ``short_n``): the line through the fastest of each
    length (``speed_run._time_tower``); without a short end, the median run (a decision's typical time:
    the check measures decisions so, median of 3) scaled linearly, which is exact for a run at the
    decision's own length."""
    if short_n is not None and shorts and n > short_n:
        per_token = (min(runs) - min(shorts)) / (n - short_n)
        if per_token > 0:
            per_call = max(0.0, min(shorts) - short_n * per_token)
            per_token = (min(runs) - per_call) / n
            return decode_calls(tokens) * per_call + tokens * per_token
    return statistics.median(runs) * tokens / n


def _speed(q: str, row: dict, decoded: int, scale: float, head: float, picture_seconds: float) -> QuantSpeed:
    if "error" in row:
        return QuantSpeed(q, error=str(row["error"]))
    n, runs = int(row["probe_tokens"]), tuple(float(t) for t in row["probe_runs"])
    short_n = int(row["short_tokens"]) if row.get("short_tokens") else None
    shorts = tuple(float(t) for t in row.get("short_runs") or ())
    at = tower_seconds(n, runs, short_n, shorts, decoded)
    tower = at * scale
    return QuantSpeed(q, n, runs, round(at, 4), round(tower, 4), round(tower + head + picture_seconds, 4),
                      round(decoded / tower, 2), short_tokens=short_n, short_runs=shorts, load=row.get("load"),
                      loaded=bool(row.get("loaded")), remeasured=bool(row.get("remeasured")))


def measure(family: str, quants: list[str], *, tokens: int = DEFAULT_TOKENS, threads: int,
            gpu_layers: dict[str, int] | None = None, reprobe: bool = False, timeout: float = TIMEOUT_S,
            workdir: Path | None = None, preset: str | None = None, picture: int | None = None) -> SpeedTable | None:
    """The speed table of ``quants`` (catalog spelling) for ``family`` on this machine, from the cache
    unless ``reprobe``; None when the family has no confirmed shapes. ``gpu_layers``: per quant, -1
    where the runtime would place that file on the GPU (``placement.gpu_layers``); absent: the CPU.
    ``preset``: another ``convert.synthetic.big`` shape (the accuracy check runs the ~110M ``small``).
    ``picture``: each decision also carries one ``picture`` x ``picture`` image (Clef-Flash's vision
    tower and processor; its tokens are added to ``tokens``).

    Each quant's window of machine load is recorded (``core.load.Meter``). A quant timed under load, or out
    of line with its kernel group (``out_of_line``), is measured once more and the quieter (else the
    faster) of its two measurements kept; one still under load is marked ``loaded`` in the table. A
    kept table's loaded quants are measured again by the next ``pick`` when the machine is quiet."""
    preset = preset or preset_for(family)
    if preset is None:
        return None
    if tokens < 1:
        raise InvalidValue(f"--tokens must be at least 1 (got {tokens})", field="tokens")
    wanted = [q.upper() for q in quants]
    gpu_layers = {q: int((gpu_layers or {}).get(q, 0)) for q in wanted}
    if picture is not None and picture < 1:
        raise InvalidValue(f"--picture must be at least 1 pixel (got {picture})", field="picture")
    key = machine_key(preset, tokens, threads, gpu_layers, picture)
    known = None if reprobe else cached(key)
    todo = [q for q in wanted if known is None or q not in known.quants]
    if known is not None:
        stale = [q for q in wanted if q in known.loaded_quants and q not in todo]
        if stale and load.contention_now(threads) <= load.LOADED_CORES:
            todo += stale  # taken under load, and the machine is quiet now
        if not todo:
            return known
    p = preset_config(preset)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="clef-gguf-speed-", dir=workdir or _scratch()) as tmp:
        decoded = max(1, tokens - SYSTEM_PREFIX_TOKENS)
        probed = list(dict.fromkeys(SAME_LAYERS.get(q, q) for q in todo))
        spec = {"workdir": tmp, "preset": preset, "quants": probed, "tokens": decoded, "threads": threads,
                "prefix": tokens - decoded,
                "gpu_layers": {SAME_LAYERS.get(q, q): n for q, n in gpu_layers.items()},
                "probe_layers": probe_layers(p), "layers": p["layers"], "head": p["head"], "picture": picture,
                "head_tokens": tokens}  # the head reads every hidden state, the prefix's too
        deadline = start + timeout
        got = probe_process.run(spec, deadline, threads)
        head = got.head
        if head is None or (picture and got.picture_seconds is None):
            raise ProbeFailed(f"the speed probe failed before measuring anything: {got.tail.strip()[-300:]}",
                              field="probe")
        picture_tokens, picture_seconds = got.picture_tokens or 0, got.picture_seconds or 0.0
        decoded += picture_tokens
        scale = p["layers"] / spec["probe_layers"]
        # a decision through the probe's layers, per probed type: this run's, and the kept table's
        at = {SAME_LAYERS.get(q, q): s.probe_seconds for q, s in (known.quants if known else {}).items()
              if s.probe_seconds is not None}
        at |= {q: s.probe_seconds for q, r in got.rows.items()
               if (s := _speed(q, r, decoded, scale, head, picture_seconds)).probe_seconds is not None}
        lines = outliers.out_of_line(at)
        suspects = [q for q in probed if "error" not in got.rows.get(q, {"error": 1})
                    and (got.rows[q]["loaded"] or q in lines)]
        again = probe_process.run({**spec, "quants": suspects}, deadline, threads, known=got) if suspects else None
    rows = {q: outliers.kept(r, again.rows.get(q) if again else None) for q, r in got.rows.items()}
    out = {q: dataclasses.replace(s, seconds=round(s.tower_seconds + head + picture_seconds, 4))
           if s.tower_seconds is not None else s for q, s in (known.quants if known else {}).items()}
    for q in todo:
        row = rows.get(SAME_LAYERS.get(q, q)) or {"error": "not measured (the probe ran out of time)"}
        out[q] = _speed(q, row, decoded, scale, head, picture_seconds)
    table = SpeedTable(family, preset, tokens, threads, gpu_layers, p["layers"], spec["probe_layers"], round(head, 4),
                       out, key, datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       round(time.monotonic() - start, 1), picture, picture_tokens, round(picture_seconds, 4))
    _write_cache(table)
    return table


@dataclass(frozen=True)
class SpeedChoice:
    """What ``--max-seconds`` / ``--prefer`` chose among the candidates, and why in words."""

    quant: str | None
    reason: str
    considered: tuple[str, ...] = field(default=())


def choose(rec: Recommendation, table: SpeedTable, *, max_seconds: float | None, prefer: str,
           keeps: set[str] | None = None) -> SpeedChoice:
    """Among the candidates that fit (and keep the eval's answers, when ``keeps``), those predicted
    within ``max_seconds``: the most accurate (catalog order; with an eval, the smallest that keeps
    them, as ``pick --eval`` chooses) or, ``prefer="speed"``, the fastest."""
    if prefer not in PREFERENCES:
        raise InvalidValue(f"--prefer must be one of {', '.join(PREFERENCES)} (got {prefer!r})", field="prefer")
    fits = [c for c in rec.candidates if c.fits]
    if keeps is not None:
        fits = [c for c in fits if c.quant.upper() in keeps]
    timed = [(c, s.seconds, s) for c in fits
             if (s := table.get(c.quant)) is not None and s.seconds is not None]
    within = [t for t in timed if max_seconds is None or t[1] <= max_seconds]
    limit = f" within {max_seconds:g} s" if max_seconds is not None else ""
    what = table.decision()
    if not within:
        if not timed:
            return SpeedChoice(None, "No quant that fits has a measured speed: run pick without --no-probe.")
        fastest = min(timed, key=lambda t: t[1])
        return SpeedChoice(None, f"No quant that fits{' and keeps your answers' if keeps is not None else ''} "
                                 f"answers{limit}: the fastest, {fastest[0].quant}, is predicted at "
                                 f"{fastest[1]:.1f} s for {what} on this machine.")
    if prefer == "speed":
        best, seconds, speed = min(within, key=lambda t: t[1])
        rule = "the fastest quant that fits"
    elif keeps is not None:
        best, seconds, speed = min(within, key=lambda t: t[0].size_bytes)
        rule = "the smallest quant that fits and keeps the eval's answers"
    else:
        best, seconds, speed = within[0]
        rule = "the most accurate quant that fits"
    rate = f"{speed.tokens_per_second:.0f} prompt tokens/s, " if speed.tokens_per_second else ""
    return SpeedChoice(best.quant, f"{best.quant} is {rule}{limit}: predicted {seconds:.1f} s for {what} "
                                   f"({rate}{table.threads} threads).",
                       tuple(t[0].quant for t in within))


def apply(rec: Recommendation, choice: SpeedChoice) -> Recommendation:
    """``rec`` with ``choice``'s quant (and that candidate's placement and need)."""
    if choice.quant is None:
        return dataclasses.replace(rec, quant=None, source=None, placement=None, need_bytes=None,
                                   reason=choice.reason)
    best = next(c for c in rec.candidates if c.quant == choice.quant)
    return dataclasses.replace(rec, quant=best.quant, source=best.source,
                               placement="gpu" if best.fits_gpu else "cpu", need_bytes=best.need_bytes,
                               reason=choice.reason)
