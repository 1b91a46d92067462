"""``clef-gguf tune``'s measurement: each run setting against its default, side by side, on this machine.

``pick`` chooses the file; ``tune`` chooses how to run it here. For each setting (threads, decode
chunk, flash attention, pack size; on a GPU the head's device and dtype) and each of its candidate
values, the model is loaded with that one value and with the defaults, and decisions of each prompt
length are timed alternately (default, candidate, then candidate, default: several rounds). A value
replaces the default only where its median is faster by more than ``NOISE`` at every length and its
answers are the default's within the setting's parity bar (``bar``). The winners are kept per machine
and tower file (``models/tuned.py``) and every command that loads the model uses them; a run that other
processes contended with keeps nothing (``tune``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from clef_gguf.core import load
from clef_gguf.core.cpus import available_cpus
from clef_gguf.core.errors import ClefError, InvalidSetting
from clef_gguf.core.limits import DECODE_CHUNK, GPU_MAX_DP
from clef_gguf.models import tuned
from clef_gguf.models.tuned import Trial, Tuning, Value

NOISE = 0.05  # a value must be faster than the default by more than this at every length
DEFAULT_LENGTHS = (466, 1986)  # a typical decision, and a long one (prompt tokens)
DEFAULT_ROUNDS = 5
# Whether a setting leaves the CPU's arithmetic as the default's (then its answers must be byte-identical):
BYTE_IDENTICAL_ON_CPU = {
    "threads": True,  # more threads split a matmul's output rows between them, never one sum
    "pack_size": True,  # each packed sequence is decoded on its one-at-a-time chunks (the tower's promise)
    "decode_chunk": False,  # the linear-attention kernels chunk by ubatch: other partial sums
    "flash_attention": False,  # another attention kernel (f16 accumulation on short ubatches)
    "head_device": False,  # the GPU's fp32 matmuls sum in another order
    "head_dtype": False,  # bf16 rounds the head's inputs and weights
}
DECODE_CHUNKS = (256, 1024, 2048)


def bar(setting: str, device: str) -> float:
    """The largest |dp| a value of ``setting`` may move answers by: 0 (byte-identical) where it keeps the
    CPU's arithmetic, else ``GPU_MAX_DP`` (on a GPU every kernel may sum in another order)."""
    return 0.0 if device == "cpu" and BYTE_IDENTICAL_ON_CPU[setting] else GPU_MAX_DP


def check_names(only: list[str] | None) -> tuple[str, ...]:
    """The settings to tune, in tune's order; an unknown name is refused, naming it."""
    if not only:
        return tuned.SETTINGS
    unknown = [name for name in only if name not in tuned.SETTINGS]
    if unknown:
        raise InvalidSetting(f"unknown setting {unknown[0]!r} for --only: tune measures "
                             f"{', '.join(tuned.SETTINGS)}", field="only")
    return tuple(name for name in tuned.SETTINGS if name in only)


class Bench(Protocol):
    """What tune measures through: the real model (``ModelBench``) or a test's fake."""

    device: tuned.Device  # where the tower runs
    tower: Path
    defaults: dict[str, Value]

    def candidates(self) -> tuple[dict[str, list[Value]], dict[str, str]]:
        """Per setting the values to try, and the settings not measured here with why."""
        ...

    def use(self, setting: str, value: Value | None) -> Any:
        """A context in which ``time``/``answers`` of ``value`` run (None: the defaults)."""
        ...

    def time(self, setting: str, value: Value | None, length: int) -> float:
        """Seconds of one decision of ``length`` tokens (``pack_size``: per decision of a packed group)."""
        ...

    def answers(self, setting: str, value: Value | None, length: int) -> np.ndarray:
        """The probabilities of what ``time`` answers, flat."""
        ...


def judge(setting: str, value: Value, lengths: tuple[int, ...], base: dict[int, list[float]],
          tried: dict[int, list[float]], max_dp: float, parity: float) -> Trial:
    """The decision rule: ``value`` wins when its median is faster than the default's by more than
    ``NOISE`` at every length and its answers are within ``parity`` (0: byte-identical)."""
    speedups = tuple(round(statistics.median(base[n]) / statistics.median(tried[n]), 4) for n in lengths)
    spreads = tuple((round(min(b / t for b, t in zip(base[n], tried[n])), 4),
                     round(max(b / t for b, t in zip(base[n], tried[n])), 4)) for n in lengths)
    same = max_dp <= parity
    fast = all(s > 1 + NOISE for s in speedups)
    at = ", ".join(f"{s:.2f}x at {n}" for s, n in zip(speedups, lengths))
    what = "byte-identical answers" if parity == 0 else f"answers within |dp| {parity:g}"
    if not same:
        reason = f"answers differ by up to {max_dp:.2g} (needs {what}); {at}"
    elif not fast:
        reason = f"not faster by more than {NOISE:.0%} at every length: {at}"
    else:
        reason = f"faster at every length: {at}; {what}"
    return Trial(setting, value, lengths, speedups, spreads, float(max_dp), parity, same and fast, reason)


def side_by_side(bench: Bench, setting: str, value: Value, lengths: tuple[int, ...],
                 rounds: int) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Times of the defaults and of ``value``, alternated: A B in even rounds, B A in odd ones."""
    base: dict[int, list[float]] = {n: [] for n in lengths}
    tried: dict[int, list[float]] = {n: [] for n in lengths}
    for n in lengths:  # one untimed decision each: kernels chosen, buffers made, the prefix kept
        bench.time(setting, None, n)
        bench.time(setting, value, n)
    for r in range(rounds):
        for n in lengths:
            order = ((None, base), (value, tried)) if r % 2 == 0 else ((value, tried), (None, base))
            for v, out in order:
                out[n].append(bench.time(setting, v, n))
    return base, tried


def tune(bench: Bench, *, only: tuple[str, ...] = tuned.SETTINGS, lengths: tuple[int, ...] = DEFAULT_LENGTHS,
         rounds: int = DEFAULT_ROUNDS, progress: Callable[[str], None] = lambda line: None) -> Tuning:
    """Every value of every setting in ``only`` against the defaults; the best winner of each is chosen.

    Each value's side-by-side runs in a window of the machine's load (``core.load``, the measure ``pick``
    takes too). When other processes contended for the measured cores in any window, the run is
    ``loaded``: its ratios measure them as much as the setting, so nothing is chosen (``Tuning.loaded``)."""
    start = time.monotonic()
    meter = load.Meter(int(bench.defaults["threads"]))
    values, skipped = bench.candidates()
    trials: list[Trial] = []
    won: dict[str, list[Trial]] = {}
    for setting in only:
        for value in values.get(setting, ()):
            meter.lap()  # the window starts here: the load's own spin-up is not this value's
            try:
                with bench.use(setting, value):
                    base, tried = side_by_side(bench, setting, value, lengths, rounds)
                    max_dp = max(float(np.abs(bench.answers(setting, None, n) - bench.answers(setting, value, n)).max())
                                 for n in lengths)
                trial = judge(setting, value, lengths, base, tried, max_dp, bar(setting, bench.device))
            except Exception as exc:  # noqa: BLE001 - a value that fails to load or run is a finding, not the end
                why = exc.message if isinstance(exc, ClefError) else f"{type(exc).__name__}: {exc}"
                trial = Trial(setting, value, lengths, (), (), None, bar(setting, bench.device), False,
                              f"could not run: {why}")
            window = meter.lap()
            trial = dataclasses.replace(trial, load=window.to_dict(), loaded=window.loaded)
            under = " (under load: not kept)" if window.loaded else ""
            progress(f"{setting}={value}: {'faster' if trial.won else 'not chosen'}{under}: {trial.reason}")
            trials.append(trial)
            if trial.won:
                won.setdefault(setting, []).append(trial)
    loaded = any(t.loaded for t in trials)
    chosen = {} if loaded else {s: max(ts, key=lambda t: min(t.speedups)).value for s, ts in won.items()}
    return Tuning(str(bench.tower.resolve()), bench.device, tuned.machine_hash(bench.device, tuned.gpu_names()
                  if bench.device == "gpu" else ()), dict(bench.defaults), chosen, tuple(trials),
                  {k: v for k, v in skipped.items() if k in only}, tuple(lengths), rounds, tuned.now(),
                  round(time.monotonic() - start, 1), loaded)


@dataclass
class ModelBench:
    """The real measurement: the model loaded with the defaults (``tune`` off, no state cache) and
    with each candidate value, decisions of synthetic requests of each length (``workload.sized_request``)."""

    settings: dict[str, Any]  # Clef.load keywords: the model and its placement
    lengths: tuple[int, ...]
    base: Any = None
    other: Any = None
    requests: dict[int, dict] = field(default_factory=dict)
    groups: dict[tuple[int, int], list[dict]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.base = self._load({})
        try:
            self._measurable()
        except BaseException:
            self.close()  # the loaded model is nobody else's to close
            raise

    def _measurable(self) -> None:
        """The defaults and the synthetic requests of each length; a PyTorch tower is refused."""
        from clef_gguf.runtime.backends import BACKENDS

        if not BACKENDS[self.base.files.backend].llama:
            name = self.base.files.tower
            raise InvalidSetting(f"tune measures llama.cpp towers; {name} runs in PyTorch (the nvfp4 backend): "
                                 "give a GGUF model", field="model")
        tower = self.base.tower
        self.device: tuned.Device = "gpu" if tower.gpu_layers else "cpu"
        self.tower = Path(self.base.files.tower)
        self.defaults: dict[str, Value] = {
            "threads": tower.threads, "decode_chunk": tower.n_batch, "flash_attention": "auto",
            "pack_size": tower.pack_rule.pack, "head_device": str(self.base.head_device),
            "head_dtype": "fp32"}
        self.exact = tower.attention == "exact-f32"
        self.packs = tower.uses_nextn
        for n in self.lengths:
            from clef_gguf.tools.workload import sized_request

            self.requests[n] = sized_request(self.base, n)

    def _load(self, extra: dict[str, Any]) -> Any:
        from clef_gguf.runtime.model import Clef

        return Clef.load(**{**self.settings, "tune": False, "state_cache_mb": 0, **extra})

    def close(self) -> None:
        for clef in (self.other, self.base):
            if clef is not None:
                clef.close()

    def candidates(self) -> tuple[dict[str, list[Value]], dict[str, str]]:
        import psutil
        import torch

        cores = available_cpus()
        values: dict[str, list[Value]] = {}
        skipped: dict[str, str] = {}
        threads = {psutil.cpu_count(logical=False) or cores, cores // 2, cores - 1}
        values["threads"] = sorted(t for t in threads if 1 <= t < cores)
        if not values["threads"]:
            skipped["threads"] = "one core: nothing to choose"
        values["decode_chunk"] = [c for c in DECODE_CHUNKS if c != DECODE_CHUNK and c <= self.base.tower.n_ctx]
        if self.exact:
            skipped["flash_attention"] = "f32 weights on the CPU keep exact f32 attention (parity with the reference)"
        else:
            values["flash_attention"] = ["on", "off"]
        pack = int(self.defaults["pack_size"])
        if self.packs:
            values["pack_size"] = sorted({1, max(1, pack // 2), pack * 2} - {pack})
        else:
            skipped["pack_size"] = "this llama.cpp build lacks the staging API that packing needs"
        on_gpu = str(self.defaults["head_device"]).startswith("cuda")
        if on_gpu:
            values["head_device"], values["head_dtype"] = ["cpu"], ["bf16"]
        elif torch.cuda.is_available():
            values["head_device"] = ["cuda"]
            skipped["head_dtype"] = "the head runs on the CPU, where bf16 is not faster"
        else:
            skipped["head_device"] = skipped["head_dtype"] = "no CUDA device: the head runs on the CPU"
        return {k: v for k, v in values.items() if v}, skipped

    @contextmanager
    def use(self, setting: str, value: Value | None) -> Iterator[None]:
        self.other = self._load({setting: value})
        try:
            yield
        finally:
            self.other.close()
            self.other = None

    def _model(self, value: Value | None) -> Any:
        return self.base if value is None else self.other

    def _group(self, n: int) -> list[dict]:
        """Distinct requests of about ``n`` tokens: two packed decodes of the largest pack tried (twice the default)."""
        size = 4 * int(self.defaults["pack_size"])
        if (n, size) not in self.groups:
            from clef_gguf.tools.workload import records

            self.groups[(n, size)] = records(self.base, n, size)
        return self.groups[(n, size)]

    def time(self, setting: str, value: Value | None, length: int) -> float:
        clef = self._model(value)
        if setting == "pack_size":
            group = self._group(length)
            start = time.perf_counter()
            list(clef.decide_many(group))
            return (time.perf_counter() - start) / len(group)
        prepared = clef.prepare(self.requests[length])
        start = time.perf_counter()
        clef.run(prepared)
        return time.perf_counter() - start

    def answers(self, setting: str, value: Value | None, length: int) -> np.ndarray:
        clef = self._model(value)
        if setting != "pack_size":
            return np.concatenate(clef.probabilities(self.requests[length]))
        encoded = [clef.prepare(r).encoded for r in self._group(length)]
        out = []
        packed = clef.tower.forward_many([(e.ids, e.prefix_tokens, e.state_tokens) for e in encoded])
        for e, got in zip(encoded, packed):
            if isinstance(got, ClefError):
                raise got
            out.append(clef.flat_probabilities(e, got[0]))
        return np.concatenate(out)
