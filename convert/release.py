"""Convert a Hugging Face Clef release into a clef-gguf model directory.

``convert_release(src, out, outtype="f32")`` writes ``out/tower-{outtype}.gguf`` (``hf_to_gguf``
writes f32/f16/bf16/q8_0 directly; every other published quant goes through an intermediate GGUF
and llama.cpp's quantizer, ``quantize``), copies the joint head files and ``tokenizer.json`` next to
it, and writes the manifest.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from clef_gguf.media.config import IMAGE_PROCESSOR_FILE, PROCESSOR_FILE, VIDEO_PROCESSOR_FILE
from clef_gguf.formats import files
from clef_gguf.convert import keep_layers as keep_layers_mod
from clef_gguf.convert import quantize
from clef_gguf.convert import tensor_map as tm
from clef_gguf.convert.hf_to_gguf import load_config, read_json, scan_checkpoint, write_tower
from clef_gguf.convert.vision import write_vision
from clef_gguf.core.errors import ConversionError, ModelNotFound

FINETUNE_PROVENANCE = "CLEF_FINETUNE.json"


def tower_name(outtype: str) -> str:
    return f"tower-{outtype}.gguf"


def intermediate_type(src: Path) -> str:
    """bf16 when every matrix in the checkpoint is bf16 (lossless, half of f32's disk), else f32."""
    found = scan_checkpoint(src)
    return "bf16" if all(dtype == "BF16" for _, shape, dtype in found.values() if len(shape) >= 2) \
        else "f32"


def write_quantized_tower(src, dst, outtype: str, *, name: str, **options) -> dict:
    """HF release -> intermediate tower (temp file beside ``dst``) -> llama.cpp quantizer -> ``dst``."""
    src, dst = Path(src), Path(dst)
    mid_type = intermediate_type(src)
    tmp = Path(tempfile.mkdtemp(prefix=".clef-gguf-convert-", dir=dst.parent))
    try:
        summary = write_tower(src, tmp / f"intermediate-{mid_type}.gguf", outtype=mid_type, name=name)
        summary["quantization"] = quantize.quantize_file(tmp / f"intermediate-{mid_type}.gguf",
                                                         dst, outtype, **options)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary


def copy_file(src: Path, dst: Path) -> None:
    """``src`` to ``dst`` (a missing one names ``src``); nothing when they are the same file."""
    if not src.is_file():
        raise ModelNotFound(f"{src.name} not found in {src.parent}", field="src")
    if src.resolve() != dst.resolve():
        shutil.copyfile(src, dst)


# What the reference's processor reads from a release (clef_gguf.media.config): copied as they are.
PROCESSOR_FILES = (PROCESSOR_FILE, IMAGE_PROCESSOR_FILE, VIDEO_PROCESSOR_FILE)


def convert_release(src, out, *, outtype: str = "f32", name: str | None = None, imatrix=None,
                    output_type: str | None = None, token_embedding_type: str | None = None,
                    threads: int | None = None, keep_layers=None) -> Path:
    """Convert the HF release in ``src`` into the clef-gguf model directory ``out``; returns ``out``.

    ``outtype`` is f32/f16/bf16/q8_0 (written here) or any published quant (``Q4_K_M``...; any
    case), which ``convert.quantize`` makes with llama.cpp's quantizer; the other keywords are
    its options (importance matrix, forced output/token-embedding types, threads, ``keep_layers``).
    q8_0 with ``keep_layers`` goes through llama.cpp's quantizer too: only it can keep some layers
    wider (its Q8_0 is byte-identical to ours).
    """
    outtype = quantize.canonical_outtype(outtype)
    quant_options = {"imatrix": imatrix, "output_type": output_type,
                     "token_embedding_type": token_embedding_type, "threads": threads}
    direct = outtype in tm.OUTTYPES and not keep_layers
    if direct and any(v is not None for v in quant_options.values()):
        raise ConversionError(f"--imatrix/--output-type/--token-embedding-type/--threads apply to "
                              f"llama.cpp quant types, not to {outtype}")
    for value in (output_type, token_embedding_type):
        quantize.ggml_type(value)  # a typo fails now, not after the conversion
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise ModelNotFound(f"source directory not found: {src}", field="src")
    keep = keep_layers_mod.resolve(keep_layers, outtype, src)  # refused before any work
    _, text, _ = load_config(src)
    head_cfg_path = src / files.HEAD_CONFIG
    if head_cfg_path.is_file():  # fail before the slow part if the head belongs to another tower
        head_hidden = read_json(head_cfg_path).get("hidden_size")
        if head_hidden is not None and head_hidden != text.get("hidden_size"):
            raise ConversionError(f"{files.HEAD_CONFIG} has hidden_size {head_hidden}, "
                                  f"the tower has {text.get('hidden_size')}")
    for role in (files.HEAD_WEIGHTS, files.HEAD_CONFIG):
        if not (src / role).is_file():
            raise ModelNotFound(f"{role} not found in {src}", field="src")
    # A release written by `clef-finetune merge` says what it was merged from: the manifest keeps it.
    provenance = src / FINETUNE_PROVENANCE
    finetune = {"finetune": read_json(provenance)} if provenance.is_file() else {}
    name = name or src.resolve().name
    tower = tower_name(outtype)
    with files.staged_directory(out) as stage:  # a failed conversion leaves no half directory
        if direct:
            summary = write_tower(src, stage / tower, outtype=outtype, name=name)
        else:
            summary = write_quantized_tower(src, stage / tower, outtype, name=name, keep_layers=keep,
                                            **quant_options)
        for fname in (files.HEAD_WEIGHTS, files.HEAD_CONFIG, files.TOKENIZER):
            copy_file(src / fname, stage / fname)
        for fname in PROCESSOR_FILES:  # the image and video processors' settings, where the release has them
            if (src / fname).is_file():
                copy_file(src / fname, stage / fname)
        vision = write_vision(src, stage)  # None for a text-only release
        source = {"path": str(src.resolve()), **summary,
                  "random_weights": (src / "RANDOM_WEIGHTS.json").is_file()}
        files.write_manifest(stage, name, outtype,
                             {"tower": tower, "head_weights": files.HEAD_WEIGHTS,
                              "head_config": files.HEAD_CONFIG, "tokenizer": files.TOKENIZER},
                             extra={"source": source, **finetune, **({"vision": vision} if vision else {})},
                             also=tuple(vision.values()) if vision else ())
    return out
