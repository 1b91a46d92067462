"""Flags and helpers shared by every command that loads a model or reads a request.

Their own module so that command modules (``serve``, ``bench``, ``parity``...) need not import
back into ``clef_gguf.cli``, which imports them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from clef_gguf import errors


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model-selection flags shared by every command that loads a model."""
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", help="a converted model directory, a .gguf next to its head "
                   "files, or a catalog name such as clef-flash:Q4_K_M / clef-flash:auto")
    g.add_argument("--gguf", help="tower GGUF path (overrides the directory's)")
    g.add_argument("--head", help="joint_head.safetensors path")
    g.add_argument("--head-config", help="joint_head_config.json path")
    g.add_argument("--tokenizer", help="tokenizer.json path")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the tower (default: all cores available to this process)")
    g.add_argument("--max-length", type=int, default=16384,
                   help="prompt window in tokens (reference: 16384); longer requests are refused")
    g.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="head precision: fp32 (default) or bf16 (the reference's numerics)")
    g.add_argument("--offline", action="store_true",
                   help="never download: catalog names resolve from the local cache only")


def load_model(args: argparse.Namespace):
    from clef_gguf.runtime import Clef

    return Clef.load(args.model, gguf=args.gguf, head=args.head, head_config=args.head_config,
                     tokenizer=args.tokenizer, threads=args.threads, max_length=args.max_length,
                     precision=args.precision, allow_download=not args.offline)


def read_request(source: str):
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise errors.InvalidValue(f"cannot read the request: {exc.strerror}: {source}",
                                  field="request") from None
    try:
        return json.loads(text)  # Python's json keeps int/float apart and key order
    except json.JSONDecodeError as exc:
        raise errors.InvalidValue(f"the request is not valid JSON: {exc}", field="request") from None
