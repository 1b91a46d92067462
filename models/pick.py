"""``clef-gguf pick``: this machine's profile and the recommended quant, in words or as JSON."""

from __future__ import annotations

import argparse
import json

from clef_gguf.core.argtypes import positive_int
from clef_gguf.core.errors import InvalidValue
from clef_gguf.models import evidence
from clef_gguf.models.machine import probe
from clef_gguf.models.placement import DEFAULT_CONTEXT, fp4_note, gib, recommend


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", default="clef-flash", help="model family (default: clef-flash)")
    parser.add_argument("--ctx", type=positive_int, default=DEFAULT_CONTEXT,
                        help=f"context tokens to budget KV for (default: {DEFAULT_CONTEXT})")
    parser.add_argument("--json", action="store_true", help="print the probe and recommendation as JSON")
    parser.add_argument("--eval", metavar="DIR",
                        help="the --output of a `clef-gguf eval` that compared quants side by side: "
                             "recommend the smallest quant that fits and keeps the reference's answers on "
                             "those records (top-1 agreement >= --min-agreement; without it, an accuracy "
                             "delta whose 95%% bootstrap interval reaches 0, else agreement >= "
                             f"{evidence.DEFAULT_AGREEMENT:g})")
    parser.add_argument("--min-agreement", type=evidence.agreement, metavar="X",
                        help="with --eval: the top-1 agreement with the eval's reference a quant must keep")
    parser.epilog = ("The recommendation is a GGUF quant. pick also lists the family's NVFP4 checkpoints "
                     "(clef-flash:nvfp4a16, clef-flash:nvfp4, clef:nvfp4; the nvfp4 backend, PyTorch on "
                     "CUDA) with their GPU memory need, and says whether this GPU runs FP4 natively "
                     "(Blackwell, compute capability 10.x/11.x/12.x: W4A4 on FP4 tensor cores) or through "
                     "the dequantizing fallback (other GPUs, and W4A16 everywhere). They are never chosen "
                     "automatically: pull one by name.")


def run(args: argparse.Namespace) -> int:
    """``clef-gguf pick``: print this machine's profile and the recommended quant; 1 if nothing fits."""
    profile = probe()
    rec = recommend(profile, args.family, context_tokens=args.ctx)
    if args.eval:
        rec = evidence.apply(rec, evidence.load(args.eval), args.min_agreement)
    elif args.min_agreement is not None:
        raise InvalidValue("--min-agreement needs --eval DIR (a clef-gguf eval of the quants)",
                           field="min_agreement")
    if args.json:
        print(json.dumps({"device": profile.to_dict(), "recommendation": rec.to_dict()}, indent=2))
        return 0 if rec.ok else 1
    feats = [n for n, on in (("AVX2", profile.avx2), ("AVX-512", profile.avx512), ("NEON", profile.neon)) if on]
    print(f"RAM:  {gib(profile.total_ram)} total, {gib(profile.available_ram)} available")
    print(f"CPU:  {profile.arch}, {profile.cpu_count} threads, features: {', '.join(feats) or 'none detected'}")
    if profile.gpus:
        for g in profile.gpus:
            free = f", {gib(g.vram_free)} free" if g.vram_free is not None else ""
            fp4 = "" if profile.unified_memory else f"; NVFP4: {fp4_note(g)}"
            print(f"GPU:  {g.index}: {g.name}, {gib(g.vram_total)} VRAM{free}{fp4}")
        offload = {True: "yes", False: "no (CPU-only build)", None: "unknown"}[profile.gpu_offload]
        print(f"      llama.cpp GPU offload: {offload}")
    else:
        print("GPU:  none")
    print(f"llama.cpp backends: {', '.join(('CPU',) + profile.backends)}"
          + ("" if profile.backends else " (a CPU-only build; see README for CUDA/Metal/Vulkan)"))
    print()
    if rec.ok and rec.placement:
        print(f"Recommended: {rec.name} (on {rec.placement.upper()})")
    else:
        print("Recommended: nothing fits")
    print(rec.reason)
    if rec.nvfp4:
        print()
        print("NVFP4 checkpoints (nvfp4 backend; pulled by name, never chosen automatically):")
        for c in rec.nvfp4:
            mark = "+" if c.suitable else "-"
            print(f"  {mark} {c.reason}")
    return 0 if rec.ok else 1
