"""``clef-gguf convert`` and ``clef-gguf demo`` (wired into ``clef_gguf.cli.COMMANDS``).

Both print one JSON summary on stdout; ``demo`` also warns on stderr that its weights are random.
Errors are raised as ``ClefError`` subclasses and rendered by ``clef_gguf.cli``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from clef_gguf.convert.hf_to_gguf import convert_release, tower_name
from clef_gguf.convert.tensor_map import OUTTYPES
from clef_gguf.convert.tiny import PRESETS, build_release

RANDOM_WARNING = "RANDOM WEIGHTS - for testing the pipeline only; the answers mean nothing."


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="Hugging Face release directory (config.json, model*.safetensors, "
                   "tokenizer.json, joint_head.safetensors, joint_head_config.json)")
    p.add_argument("out", help="output model directory (created if missing)")
    p.add_argument("--outtype", choices=list(OUTTYPES), default="f32",
                   help="tower storage type (norms and 1-D tensors stay f32); quantize further "
                        "with llama.cpp's llama-quantize from f32/bf16")
    p.add_argument("--name", help="model name in the GGUF and the manifest (default: SRC's name)")


def _summary(out: Path, outtype: str, seconds: float, **extra) -> str:
    return json.dumps({"model_dir": str(out), "tower": str(out / tower_name(outtype)),
                       "outtype": outtype, "seconds": round(seconds, 3), **extra}, indent=2)


def run_convert(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    out = convert_release(args.src, args.out, outtype=args.outtype, name=args.name)
    print(_summary(out, args.outtype, time.perf_counter() - start))
    return 0


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="output directory: the model goes here, the random HF release "
                   "into OUT/release")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny",
                   help="size of the random model (tiny: instant; medium: ~0.66B parameters, "
                        "~1.3 GB, for timing only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--outtype", choices=list(OUTTYPES), default="f32", help="tower storage type")


def run_demo(args: argparse.Namespace) -> int:
    print(f"clef-gguf demo: {RANDOM_WARNING}", file=sys.stderr)
    start = time.perf_counter()
    out = Path(args.out)
    release = build_release(out / "release", preset=args.preset, seed=args.seed)
    convert_release(release, out, outtype=args.outtype, name=f"clef-random-{args.preset}-seed{args.seed}")
    print(_summary(out, args.outtype, time.perf_counter() - start, release=str(release),
                   preset=args.preset, seed=args.seed, warning=RANDOM_WARNING))
    return 0
