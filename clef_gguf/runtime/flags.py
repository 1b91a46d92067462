"""Flags and helpers shared by every command that loads a model or reads a request.

Their own module so that command modules (``serve``, ``bench``, ``parity``...) need not import
back into ``clef_gguf.cli``, which imports them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_gguf.core.argtypes import gpu_layers, megabytes, positive_int
from clef_gguf.core import errors
from clef_gguf.tower import cache as statecache
from clef_gguf.core.limits import CONTEXT_WINDOW

if TYPE_CHECKING:
    from clef_gguf.runtime.model import Clef


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model-selection flags shared by every command that loads a model."""
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", help="a converted model directory, a .gguf next to its head "
                   "files, or a catalog name such as clef-flash:Q4_K_M / clef-flash:auto")
    g.add_argument("--backend", choices=["auto", "gguf", "nvfp4"], default="auto",
                   help="which tower runs: gguf (llama.cpp on a .gguf), nvfp4 (PyTorch on a "
                        "compressed-tensors NVFP4/NVFP4A16 checkpoint directory: native FP4 on "
                        "Blackwell GPUs, a dequantizing fallback on other GPUs and, slowly, on the "
                        "CPU); auto (default): what the model's files are")
    g.add_argument("--gguf", help="tower GGUF path (overrides the directory's)")
    g.add_argument("--head", help="joint_head.safetensors path")
    g.add_argument("--head-config", help="joint_head_config.json path")
    g.add_argument("--tokenizer", help="tokenizer.json path")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for the tower (default: all cores available to this process)")
    g.add_argument("--head-threads", type=positive_int, default=None,
                   help="torch threads for the head (default: as many as the tower; the head runs "
                        "after the tower on the same cores)")
    g.add_argument("--gpu-layers", type=gpu_layers, default="auto",
                   help="tower layers on the GPU: auto (default: all when this llama-cpp-python "
                        "build has a GPU backend and the model fits, as `clef-gguf pick` says; "
                        "else 0), all, or a count; 0 keeps it on the CPU (nvfp4: auto/all use "
                        "CUDA when present, 0 the CPU)")
    g.add_argument("--max-length", type=positive_int, default=CONTEXT_WINDOW,
                   help=f"prompt window in tokens (reference: {CONTEXT_WINDOW}); longer requests are refused")
    g.add_argument("--head-dtype", "--precision", dest="head_dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the head's dtype: fp32 (default) or bf16 (the reference's numerics); --precision is "
                        "its earlier name")
    g.add_argument("--offline", action="store_true",
                   help="never download: catalog names resolve from the local cache only")
    g.add_argument("--state-cache-mb", type=megabytes, default=statecache.DEFAULT_MB,
                   help="memory for reusing decoded states: another question set about a state "
                        "seen before decodes only its questions, a repeated request skips the "
                        f"tower (default {statecache.DEFAULT_MB} MiB; 0 turns it off)")
    g.add_argument("--strict", action="store_true",
                   help="refuse keys the reference ignores (unknown_field) and apply Jev's limits "
                        "(1-64 questions, 2-255 choice options, 2-10 score levels); by default "
                        "they are ignored and named in the response's \"warnings\"")
    g.add_argument("--calibration", metavar="CAL.json", default=None,
                   help="apply the temperatures a `clef-gguf calibrate` file fitted for this very "
                        "model (softmax(logits / T) per question; audit.calibration_version names "
                        "it); a file fitted on other weights is refused. Default: none (T = 1, "
                        "the reference's probabilities)")
    add_adapter_argument(g)


def add_adapter_argument(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--adapter", action="append", metavar="[NAME=]DIR", default=None,
                   help="a fine-tune on this tower (a `clef-gguf convert adapter` directory: a LoRA "
                        "applied by llama.cpp at run time, on any quant of its base, plus its head). "
                        "One bare DIR: it answers every request. Repeat as NAME=DIR for several: "
                        "the tower loads once, the base answers unless a request's \"model\" names "
                        "one (an unknown name: error unknown_model)")


def load_model(args: argparse.Namespace) -> Clef:
    from clef_gguf.runtime import finetunes
    from clef_gguf.runtime.model import Clef

    return Clef.load(args.model, gguf=args.gguf, head=args.head, head_config=args.head_config,
                     tokenizer=args.tokenizer, threads=args.threads, max_length=args.max_length,
                     head_dtype=args.head_dtype, allow_download=not args.offline,
                     strict=args.strict, state_cache_mb=args.state_cache_mb,
                     gpu_layers=args.gpu_layers, head_threads=args.head_threads,
                     backend=args.backend, calibration=getattr(args, "calibration", None),
                     adapters=finetunes.parse_flags(getattr(args, "adapter", None)))


def read_request(source: str) -> Any:
    try:
        raw = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except OSError as exc:
        raise errors.InvalidValue(f"cannot read the request: {exc.strerror}: {source}",
                                  field="request") from None
    from clef_gguf.pipeline.request import parse_json  # pydantic: only for the commands that read one

    return parse_json(raw)
