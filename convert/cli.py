"""``clef-gguf convert``, ``convert adapter`` and ``demo`` (wired into ``clef_gguf.cli.COMMANDS``).

Each prints one JSON summary on stdout; ``demo`` also warns on stderr that its weights are random.
Errors are raised as ``ClefError`` subclasses and rendered by ``clef_gguf.cli``.

``convert`` takes a Hugging Face release, or an already converted f32/f16/bf16 model directory
(one with ``clef-gguf.json``), which it only quantizes: convert once, quantize many times.
``convert adapter`` turns a LoRA fine-tune into a fine-tune directory for a converted base
(``convert.lora``); ``demo --finetune`` adds a random one to the demo model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from clef_gguf.core.argtypes import positive_int
from clef_gguf.core import errors
from clef_gguf.formats import files
from clef_gguf.convert import keep_layers, lora, nvfp4_to_gguf, quantize
from clef_gguf.convert.synthetic.finetune_demo import build_finetune_checkpoint
from clef_gguf.convert.release import convert_release, tower_name
from clef_gguf.convert.synthetic.tiny import PRESETS, build_release
from clef_gguf.formats.finetune_files import adapter_file_name, read_adapter_manifest

RANDOM_WARNING = "RANDOM WEIGHTS - for testing the pipeline only; the answers mean nothing."
OUTTYPE_HELP = ("f32 (default), f16, bf16, q8_0 (written directly; norms and 1-D tensors stay f32), "
                "a quant made by llama.cpp's quantizer, any case: "
                + ", ".join(t for t in quantize.PUBLISHED if t not in ("BF16", "Q8_0"))
                + "; or nvfp4a16 (FP4 weights) / nvfp4 (FP4 weights and activations, calibrated "
                "on built-in prompts): a compressed-tensors checkpoint for `--backend nvfp4`; or "
                "nvfp4-gguf: a tower GGUF whose projections are llama.cpp NVFP4 tensors (a release is "
                "quantized to NVFP4A16 and re-encoded; an NVFP4/NVFP4A16 checkpoint as SRC is re-encoded, "
                "bit for bit, and is recognised without the flag)")
NVFP4_SCHEMES = ("nvfp4a16", "nvfp4")
# Where `demo --finetune` puts the random checkpoint and its conversion, inside OUT.
DEMO_CHECKPOINT = "finetune-checkpoint"
DEMO_FINETUNE = "finetune"


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="Hugging Face release directory (config.json, model*.safetensors, "
                   "tokenizer.json, joint_head.safetensors, joint_head_config.json), a converted "
                   "f32/f16/bf16 model directory to quantize, or a compressed-tensors NVFP4 checkpoint "
                   "(to nvfp4-gguf)")
    p.add_argument("out", help="output model directory (created if missing)")
    p.add_argument("--outtype", metavar="TYPE", help=OUTTYPE_HELP)
    p.add_argument("--name", help="model name in the GGUF and the manifest (default: SRC's name)")
    g = p.add_argument_group("llama.cpp quantizer (quant types only)")
    g.add_argument("--imatrix", metavar="FILE|uniform",
                   help="importance matrix from llama.cpp's llama-imatrix (GGUF or legacy .dat); "
                        "IQ1_*, IQ2_*, IQ3_XXS, IQ3_XS and Q2_K_S need one. 'uniform' uses flat "
                        "weights: the file works but is worse than with a calibrated matrix")
    g.add_argument("--output-type", metavar="GGML_TYPE",
                   help="force output.weight (the lexical rows) to this tensor type, e.g. Q8_0")
    g.add_argument("--token-embedding-type", metavar="GGML_TYPE",
                   help="force token_embd.weight to this tensor type")
    g.add_argument("--threads", type=positive_int, help="quantizer threads (default: all available)")
    g.add_argument("--keep-layers", action="append", metavar="RANGE=TYPE",
                   help="keep these decoder layers' weights at a wider tensor type than the quant's "
                        "mix, e.g. 0-7=Q8_0, 0-3=f16, 10=Q6_K, 0-7,30-31=Q8_0 (repeatable); q8_0 and "
                        "the llama.cpp quant types")


def _summary(out: Path, outtype: str, seconds: float, **extra) -> str:
    return json.dumps({"model_dir": str(out), "tower": str(out / tower_name(outtype)),
                       "outtype": outtype, "seconds": round(seconds, 3), **extra}, indent=2)


def run_convert(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    src = Path(args.src)
    asked = (args.outtype or "").strip().lower()
    if asked == nvfp4_to_gguf.OUTTYPE or (not asked and nvfp4_to_gguf.is_checkpoint(src)):
        return _run_nvfp4_gguf(args, src, start)
    if nvfp4_to_gguf.is_checkpoint(src):
        raise errors.ConversionError(f"{src} is an NVFP4 checkpoint: it converts to {nvfp4_to_gguf.OUTTYPE} "
                                     f"(re-encoded, not --outtype {args.outtype}); convert its release for "
                                     "other types", field="outtype")
    if asked in NVFP4_SCHEMES:
        return _run_nvfp4(args, start)
    outtype = quantize.canonical_outtype(args.outtype or "f32")
    options = {"imatrix": args.imatrix, "output_type": args.output_type,
               "token_embedding_type": args.token_embedding_type, "threads": args.threads,
               "keep_layers": keep_layers.resolve(args.keep_layers, outtype, src)}  # before any work
    extra = {}
    if (src / files.MANIFEST).is_file():  # a converted model directory: quantize its tower
        out = quantize.quantize_model(src, args.out, outtype, name=args.name, **options)
        extra["quantization"] = files.read_manifest(out).get("source", {}).get("quantization")
    else:
        out = convert_release(src, args.out, outtype=outtype, name=args.name, **options)
    print(_summary(out, outtype, time.perf_counter() - start, **extra))
    return 0


def _no_quantizer_flags(args: argparse.Namespace, outtype: str) -> None:
    given = [flag for flag, value in (("--imatrix", args.imatrix), ("--output-type", args.output_type),
                                      ("--token-embedding-type", args.token_embedding_type),
                                      ("--threads", args.threads),
                                      ("--keep-layers", args.keep_layers)) if value is not None]
    if given:
        raise errors.ConversionError(f"{', '.join(given)} apply to llama.cpp quant types, not to {outtype}")


def _run_nvfp4_gguf(args: argparse.Namespace, src: Path, start: float) -> int:
    """A checkpoint re-encoded; a release quantized to NVFP4A16 first (in a scratch directory beside OUT)."""
    _no_quantizer_flags(args, nvfp4_to_gguf.OUTTYPE)
    out = Path(args.out)
    if (src / files.MANIFEST).is_file() and not nvfp4_to_gguf.is_checkpoint(src):
        raise errors.ConversionError(f"{src} is a converted model directory: {nvfp4_to_gguf.OUTTYPE} is made from a "
                                     "release or an NVFP4 checkpoint", field="src")
    if nvfp4_to_gguf.is_checkpoint(src):
        nvfp4_to_gguf.convert_checkpoint(src, out, name=args.name)
    else:
        from clef_gguf.convert.nvfp4 import quantize_release  # torch + compressed-tensors: only here

        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".clef-gguf-nvfp4-", dir=out.parent) as tmp:
            checkpoint = quantize_release(src, Path(tmp) / "checkpoint", scheme="nvfp4a16", name=args.name)
            nvfp4_to_gguf.convert_checkpoint(checkpoint, out, name=args.name or src.resolve().name)
    scheme = (files.read_manifest(out).get("source") or {}).get("scheme")
    print(_summary(out, nvfp4_to_gguf.OUTTYPE, time.perf_counter() - start, scheme=scheme))
    return 0


def _run_nvfp4(args: argparse.Namespace, start: float) -> int:
    from clef_gguf.convert.nvfp4 import quantize_release  # torch + compressed-tensors: only here

    scheme = args.outtype.strip().lower()
    _no_quantizer_flags(args, scheme)
    out = quantize_release(args.src, args.out, scheme=scheme, name=args.name)
    print(json.dumps({"model_dir": str(out), "tower": str(out / files.CHECKPOINT_CONFIG),
                      "outtype": scheme, "backend": "nvfp4",
                      "seconds": round(time.perf_counter() - start, 3)}, indent=2))
    return 0


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="output directory: the model goes here, the random HF release "
                   "into OUT/release")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny",
                   help="size of the random model (tiny: instant; small: ~110M parameters, for "
                        "benchmarks; medium: ~0.66B parameters, "
                        "~1.3 GB, for timing only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--outtype", default="f32", metavar="TYPE",
                   help=OUTTYPE_HELP + " (quants get a uniform importance matrix: the weights are "
                   "random, there is nothing to calibrate)")
    p.add_argument("--finetune", action="store_true",
                   help="also write a random fine-tune checkpoint (clef-finetune's layout) into "
                        "OUT/finetune-checkpoint and convert it into OUT/finetune, for --adapter")


def run_demo(args: argparse.Namespace) -> int:
    print(f"clef-gguf demo: {RANDOM_WARNING}", file=sys.stderr)
    start = time.perf_counter()
    out = Path(args.out)
    release = build_release(out / "release", preset=args.preset, seed=args.seed)
    outtype = quantize.canonical_outtype(args.outtype)
    name = f"clef-random-{args.preset}-seed{args.seed}"
    convert_release(release, out, outtype=outtype, name=name,
                    imatrix=None if outtype in quantize.DIRECT_TYPES else "uniform")
    extra: dict[str, str] = {}
    if args.finetune:
        checkpoint = build_finetune_checkpoint(release, out / DEMO_CHECKPOINT, seed=args.seed + 1)
        lora_type = "f32" if outtype == "f32" else "f16"
        finetune = lora.convert_adapter(checkpoint, out / DEMO_FINETUNE, base=out, outtype=lora_type,
                                        name=f"{name}-finetune")
        extra = {"finetune_checkpoint": str(checkpoint), "finetune": str(finetune),
                 "finetune_adapter": str(finetune / adapter_file_name(lora_type))}
    print(_summary(out, outtype, time.perf_counter() - start, release=str(release),
                   preset=args.preset, seed=args.seed, **extra, warning=RANDOM_WARNING))
    return 0


def add_adapter_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="clef-finetune checkpoint directory (adapter/ with PEFT's "
                   "adapter_config.json and adapter_model.safetensors, joint_head.safetensors, "
                   "train_config.json), or a bare PEFT LoRA directory with --head")
    p.add_argument("out", help="output fine-tune directory (created if missing)")
    p.add_argument("--base", required=True, metavar="MODEL",
                   help="the converted clef-gguf model directory the fine-tune was trained from "
                        "(any quant: the adapter runs on every quant of its tower)")
    p.add_argument("--outtype", default="f16", choices=list(lora.OUTTYPES),
                   help="storage type of the LoRA matrices (default f16; q8_0 keeps rows that do "
                        "not fill 32-value blocks in f16)")
    p.add_argument("--name", help="fine-tune name in the manifest (default: CHECKPOINT's name)")
    p.add_argument("--head", metavar="FILE",
                   help="the fine-tune's joint_head.safetensors (default: the one in CHECKPOINT)")


def run_adapter(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    out = lora.convert_adapter(args.checkpoint, args.out, base=args.base, outtype=args.outtype,
                               name=args.name, head=args.head)
    manifest = read_adapter_manifest(out)
    print(json.dumps({"finetune_dir": str(out), "adapter": str(out / manifest["adapter"]),
                      "outtype": args.outtype, "rank": manifest["lora"]["rank"],
                      "alpha": manifest["lora"]["alpha"], "targets": manifest["lora"]["targets"],
                      "base": manifest["base"]["name"], "seconds": round(time.perf_counter() - start, 3)},
                     indent=2))
    return 0
