"""``clef-gguf tune``: measure how to run a model on this machine, keep the winners, or show them.

Its flags are generated from ``TuneSettings`` (``core.commandline``), declared once."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Annotated, Literal

import pydantic
from pydantic import Field

from clef_gguf.core import argtypes
from clef_gguf.core.commandline import CommandSettings, Flag
from clef_gguf.core.errors import InvalidValue
from clef_gguf.core.limits import CONTEXT_WINDOW, GPU_MAX_DP
from clef_gguf.models import tuned
from clef_gguf.models.tuned import Tuning
from clef_gguf.tools import tune


def _lengths(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected prompt lengths such as 466,1986 (got {text!r})") from None
    if not out or any(n < 1 or n > CONTEXT_WINDOW for n in out):
        raise argparse.ArgumentTypeError(f"each length must be 1 to {CONTEXT_WINDOW} tokens (got {text!r})")
    return out


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


class TuneSettings(CommandSettings):
    """``clef-gguf tune``'s settings: what to measure and how, or only show what was kept."""

    model: Annotated[str, Flag(("--model", "-m"))] = Field(description=(
        "a converted model directory, a .gguf next to its head files, or a catalog name"))
    gpu_layers: Annotated[Annotated[int, pydantic.Strict(), Field(ge=-1)] | Literal["auto", "all"],
                          Flag(type=argtypes.gpu_layers)] = Field(default="auto", description=(
        "tower layers on the GPU while measuring, as the commands will run it (default auto)"))
    offline: Annotated[bool, Flag(action="store_true")] = Field(default=False, description=(
        "never download: a catalog name must be cached"))
    lengths: Annotated[tuple[int, ...], Flag(type=_lengths, metavar="N,N")] = Field(
        default=tune.DEFAULT_LENGTHS, description=(
            "prompt lengths in tokens to time at; a value must win at every one "
            f"(default {','.join(map(str, tune.DEFAULT_LENGTHS))})"))
    rounds: Annotated[int, pydantic.Strict(), Field(ge=1), Flag(type=argtypes.positive_int, metavar="N")] = Field(
        default=tune.DEFAULT_ROUNDS, description=(
            f"alternated rounds per value and length (default {tune.DEFAULT_ROUNDS})"))
    only: Annotated[list[str] | None, Flag(type=_names, metavar="NAME[,NAME...]")] = Field(
        default=None, description=f"tune only these settings (of {', '.join(tuned.SETTINGS)})")
    show: Annotated[bool, Flag(action="store_true")] = Field(default=False, description=(
        "measure nothing: say what tune chose for this model on this machine, and why"))
    as_json: Annotated[bool, Flag(("--json",), action="store_true")] = Field(default=False, description=(
        "print the full result as JSON on stdout"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    TuneSettings.add_arguments(p)
    p.epilog = ("Each setting's values are timed against its default side by side (alternating, --rounds "
                "rounds, median and spread) at every --lengths. A value replaces the default only where it "
                f"is more than {tune.NOISE:.0%} faster at every length with the same answers: byte-identical "
                "on the CPU for threads and pack size, which keep its arithmetic, else within max |dp| "
                f"{GPU_MAX_DP:g}. The winners are kept per machine, llama.cpp build and model in "
                "$HF_HOME/clef-gguf/tuned-settings.json, and every command that loads this model uses them "
                "where no flag sets them (--no-tune: the defaults). A run during which other processes kept "
                "the measured cores busy keeps nothing (it says so): run it again on a quiet machine.")


def _settings(args: TuneSettings) -> dict:
    return {"model": args.model, "gpu_layers": args.gpu_layers, "allow_download": not args.offline}


def describe(t: Tuning, status: str = "") -> str:
    head = (f"tune: {t.model} on the {t.device}: {', '.join(map(str, t.lengths))}-token decisions, "
            f"{t.rounds} rounds, measured {t.measured_at} in {t.took_seconds:.1f} s{status}")
    lines = [head]
    for trial in t.trials:
        spread = "; ".join(f"{lo:.2f}-{hi:.2f}" for lo, hi in trial.spreads)
        verdict = ("faster, but timed under load" if trial.won and trial.loaded else
                   "WINS" if trial.won and not t.loaded else "faster" if trial.won else "kept the default")
        load = (f"; other processes held {trial.load['contended_cores']:.2f} of its cores"
                if trial.loaded and trial.load else "")
        lines.append(f"  {trial.setting}={trial.value} ({t.defaults.get(trial.setting)} by default): "
                     f"{verdict}: {trial.reason} (per-round spread {spread}{load})")
    for setting, why in t.skipped.items():
        lines.append(f"  {setting}: not measured: {why}")
    if t.loaded:
        lines.append("chosen: nothing: other processes kept the measured cores busy while tune ran, so its "
                     "ratios measure them too. Nothing was kept; the settings in force are unchanged. Run "
                     "`clef-gguf tune` again when the machine is quiet.")
        return "\n".join(lines)
    chosen = ", ".join(f"{k}={v}" for k, v in t.chosen.items())
    lines.append(f"chosen: {chosen} (every command loading this model here uses it; --no-tune: the defaults)"
                 if chosen else "chosen: nothing: the defaults stand")
    return "\n".join(lines)


def show(args: TuneSettings) -> int:
    from clef_gguf.runtime.load import resolve
    from clef_gguf.runtime.settings import LoadSettings

    tower = resolve(LoadSettings.of(**_settings(args) | {"allow_download": False})).tower  # shows, never downloads
    found = {device: (t, t is not None and tuned.current(tower, device) is not None)
             for device in ("cpu", "gpu") if (t := tuned.kept(tower, device)) is not None}
    if args.as_json:
        print(json.dumps({"model": str(Path(tower).resolve()), "tunings": {
            d: t.to_dict() | {"current": ok} for d, (t, ok) in found.items()}}, indent=2))
        return 0
    if not found:
        print(f"tune: nothing kept for {tower}: run `clef-gguf tune --model {args.model}`")
    for device, (t, ok) in found.items():
        print(describe(t, "" if ok else " (STALE: measured on another machine or llama.cpp build: not used; "
                                          "run tune again)"))
    return 0


def run(flags: argparse.Namespace) -> int:
    args = TuneSettings.from_args(flags)
    if args.show:
        return show(args)
    only = tune.check_names(args.only)  # an unknown name is refused before any model loads
    if args.rounds < 2:
        raise InvalidValue("--rounds must be at least 2 (a spread needs two rounds)", field="rounds")
    bench = tune.ModelBench(_settings(args), args.lengths)
    try:
        result = tune.tune(bench, only=only, lengths=args.lengths, rounds=args.rounds,
                           progress=lambda line: print(f"tune: {line}", file=sys.stderr, flush=True))
    finally:
        bench.close()
    if not result.loaded:
        tuned.store(result)  # a home that cannot be written is an error: nothing is said to be kept
    print(json.dumps(result.to_dict() | {"kept": not result.loaded}, indent=2) if args.as_json else describe(result))
    return 0
