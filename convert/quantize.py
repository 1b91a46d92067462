"""Quantize a tower GGUF with llama.cpp's own quantizer (``llama_model_quantize``), safely.

Every published Clef GGUF type below BF16 is made this way: the converter writes a lossless
intermediate (bf16 when the checkpoint is bf16, else f32) and llama.cpp quantizes it with its
usual per-tensor mix (``src/llama-quant.cpp``): Q4_K_M keeps some tensors at Q6_K, the IQ1/IQ2
mixes put ``output.weight`` at Q5_K, and so on. ``q8_0`` is the exception: our writer's Q8_0 is
byte-identical to llama.cpp's (tested), so it skips the detour.

The quantizer runs in a child process (``python -m clef_gguf.convert.quantize SPEC``): ggml
aborts the whole process on some inputs (``GGML_ASSERT(imatrix != NULL)`` when an IQ2/IQ1 tensor
type is forced without an importance matrix, a remap error...). In a child an abort is just an
exit status, which becomes a ``ConversionError`` naming the type and llama.cpp's last words.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clef_gguf.convert import keep_layers as keep_layers_mod
from clef_gguf.core.children import module_command
from clef_gguf.core.cpus import available_cpus
from clef_gguf.core.errors import ConversionError


def _c_string(text: str, limit: int) -> bytes:
    """UTF-8 of ``text`` in at most ``limit`` bytes, never cut inside a character."""
    return text.encode()[:limit].decode("utf-8", "ignore").encode()

# Published name -> llama_ftype (vendored include/llama.h). llama-cpp-python 0.3.36 has no
# LLAMA_FTYPE_MOSTLY_Q1_0/Q2_0 constants; their values 40/41 come from that header.
QUANT_TYPES: dict[str, int] = {
    "Q6_K": 18, "Q5_1": 9, "Q5_K_M": 17, "Q5_K_S": 16, "Q5_0": 8, "Q4_K_M": 15, "Q4_1": 3,
    "IQ4_NL": 25, "Q4_K_S": 14, "Q4_0": 2, "IQ4_XS": 30, "Q3_K_L": 13, "Q3_K_M": 12, "IQ3_M": 27,
    "IQ3_S": 26, "Q3_K_S": 11, "IQ3_XS": 22, "IQ3_XXS": 23, "Q2_K": 10, "Q2_K_S": 21, "IQ2_M": 29,
    "IQ2_S": 28, "Q2_0": 41, "IQ2_XS": 20, "IQ2_XXS": 19, "IQ1_M": 31, "IQ1_S": 24, "Q1_0": 40,
    "Q8_0": 7,  # reachable through quantize_file; convert routes q8_0 to the direct writer
}
# Written by our converter directly (tensor_map.OUTTYPES), spelled as the converter always has.
DIRECT_TYPES = ("f32", "f16", "bf16", "q8_0")
# The community card's set: BF16 plus 29 quants, best first.
PUBLISHED = ("BF16", "Q8_0", "Q6_K", "Q5_1", "Q5_K_M", "Q5_K_S", "Q5_0", "Q4_K_M", "Q4_1", "IQ4_NL",
             "Q4_K_S", "Q4_0", "IQ4_XS", "Q3_K_L", "Q3_K_M", "IQ3_M", "IQ3_S", "Q3_K_S", "IQ3_XS",
             "IQ3_XXS", "Q2_K", "Q2_K_S", "IQ2_M", "IQ2_S", "Q2_0", "IQ2_XS", "IQ2_XXS", "IQ1_M",
             "IQ1_S", "Q1_0")
# Types whose llama.cpp mix has tensors in IQ1_*/IQ2_*/IQ3_XXS, or Q2_K inside a Q2_K_S file:
# llama.cpp refuses them without an importance matrix (llama-quant.cpp tensor_requires_imatrix).
NEEDS_IMATRIX = frozenset({"IQ3_XS", "IQ3_XXS", "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS",
                           "IQ1_M", "IQ1_S"})
# Tensor types ggml refuses to quantize without weights (ggml.c ggml_quantize_requires_imatrix):
# llama.cpp does not check forced output/token_embd types against it, ggml asserts instead.
GGML_NEEDS_IMATRIX = ("IQ2_XXS", "IQ2_XS", "IQ1_S")
_SOURCE_FTYPES = {0: "f32", 1: "f16", 32: "bf16"}


def canonical_outtype(name: str) -> str:
    """``q4_k_m`` / ``Q4_K_M`` -> ``Q4_K_M``; the direct types stay lower case (``BF16`` -> ``bf16``)."""
    key = str(name).strip()
    if key.lower() in DIRECT_TYPES:
        return key.lower()
    if key.upper() in QUANT_TYPES:
        return key.upper()
    raise ConversionError(f"unknown outtype {name!r}; choose one of {', '.join(DIRECT_TYPES)}, "
                          f"{', '.join(t for t in QUANT_TYPES if t != 'Q8_0')}")


def ggml_type(name: str | None) -> int | None:
    """A tensor type name (``Q6_K``, ``q2_0``, ``f16``) -> ggml type id, for the override options."""
    if name is None:
        return None
    import gguf

    from clef_gguf.formats.gguf import ensure_gguf_types

    ensure_gguf_types()
    member = gguf.GGMLQuantizationType.__members__.get(str(name).upper())
    if member is None or member.name in ("I8", "I16", "I32", "I64", "F64", "Q8_1", "Q8_K"):
        known = [t.name for t in gguf.GGMLQuantizationType if t.name not in ("I8", "I16", "I32",
                                                                            "I64", "F64", "Q8_1", "Q8_K")]
        raise ConversionError(f"unknown tensor type {name!r}; choose one of {', '.join(known)}")
    return int(member)


def _threads(threads: int | None) -> int:
    return int(threads) if threads else available_cpus()


def _source_type(path: Path) -> str:
    from clef_gguf.formats.gguf import field_value, open_gguf

    reader = open_gguf(path)
    ft = field_value(reader, "general.file_type")
    if ft not in _SOURCE_FTYPES:
        raise ConversionError(f"{path.name} is already quantized (file type {ft}); llama.cpp "
                              "quantizes from f32/f16/bf16 only: convert the release again")
    return _SOURCE_FTYPES[ft]


def _resolve_imatrix(imatrix, src: Path, workdir: Path) -> tuple[str | None, dict]:
    """(path for the child, metadata) for ``None``, ``"uniform"``, a file, or an ImportanceMatrix."""
    from clef_gguf.convert import imatrix_file as im

    if imatrix is None:
        return None, {}
    if isinstance(imatrix, str) and imatrix == im.UNIFORM:
        m = im.uniform_for(src)
    elif isinstance(imatrix, im.ImportanceMatrix):
        m = imatrix
    else:
        m = im.read(imatrix)  # fail here, clearly, rather than in the child
        m.source = Path(imatrix).name
        with open(imatrix, "rb") as fh:
            if fh.read(4) == b"GGUF":  # the child reads it as is; a legacy .dat is rewritten
                return str(Path(imatrix).resolve()), _imatrix_meta(m)
    path = workdir / "imatrix.gguf"
    im.write(path, m)
    return str(path), _imatrix_meta(m)


def _imatrix_meta(m) -> dict:
    return {"file": m.source, "dataset": (m.datasets or [""])[0], "entries": len(m.entries),
            "chunks": m.chunks}


def _failure(outtype: str, proc: subprocess.CompletedProcess) -> ConversionError:
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    said = [ln for ln in lines if any(k in ln for k in ("error", "ERROR", "failed", "GGML_ASSERT",
                                                         "offending tensor", "Missing importance"))]
    detail = "; ".join(dict.fromkeys((said or lines)[-3:]))[-600:]  # ggml repeats its assert line
    if "requires an imatrix" in proc.stderr or "Missing importance matrix" in proc.stderr:
        return ConversionError(
            f"{outtype} needs an importance matrix (llama.cpp: {detail}). Pass --imatrix FILE "
            f"(llama-imatrix output, GGUF or legacy .dat) or --imatrix uniform (flat weights: works, "
            f"lower quality than a calibrated matrix)")
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = f"signal {-proc.returncode}"
        return ConversionError(f"llama.cpp aborted while quantizing to {outtype} ({sig}): {detail}")
    return ConversionError(f"llama.cpp could not quantize to {outtype}: {detail}")


def quantize_file(src, dst, outtype: str, *, imatrix=None, output_type: str | None = None,
                  token_embedding_type: str | None = None, threads: int | None = None,
                  timeout: float | None = None, keep_layers=None) -> dict:
    """Quantize the f32/f16/bf16 tower GGUF ``src`` into ``dst``; returns a summary dict.

    ``imatrix``: None, a llama.cpp imatrix file, ``"uniform"`` or an ``ImportanceMatrix``.
    ``output_type`` / ``token_embedding_type``: force ``output.weight`` / ``token_embd.weight`` to a
    ggml type (llama-quantize's ``--output-tensor-type`` / ``--token-embedding-type``).
    ``timeout``: seconds before the child is killed (None: no limit; a 27B model takes a while).
    ``keep_layers``: ``--keep-layers`` values (``["0-7=Q8_0"]``) or a ``KeepLayers``: those decoder
    layers are written at the wider type (``convert.keep_layers``).
    """
    src, dst = Path(src), Path(dst)
    name = outtype.upper()
    if name not in QUANT_TYPES:
        canonical_outtype(outtype)  # the "unknown outtype" message
        raise ConversionError(f"{outtype} is written by the converter, not quantized: use convert")
    source_type = _source_type(src)
    keep = keep_layers_mod.resolve(keep_layers, name, src)
    forced = {"output": output_type, "token_embd": token_embedding_type}
    ids = {k: ggml_type(v) for k, v in forced.items()}
    bad = [f"{k} {v.upper()}" for k, v in forced.items() if v and v.upper() in GGML_NEEDS_IMATRIX]
    if bad and imatrix is None:  # ggml would GGML_ASSERT: say it before starting
        raise ConversionError(f"forcing {', '.join(bad)} needs an importance matrix: pass --imatrix")
    start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix=".clef-gguf-quantize-", dir=dst.parent))
    partial = dst.with_name(dst.name + ".partial")
    try:
        im_path, im_meta = _resolve_imatrix(imatrix, src, workdir)
        spec = {"src": str(src), "dst": str(partial), "ftype": QUANT_TYPES[name],
                "threads": _threads(threads), "output_type": ids["output"],
                "token_embedding_type": ids["token_embd"], "imatrix": im_path, "imatrix_meta": im_meta,
                "keep_layers": {str(k): v for k, v in keep.layers.items()} if keep else None}
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        # GGML_NO_BACKTRACE: on an assert ggml forks gdb (or backtrace_symbols) from every failing
        # thread; in a multi-threaded quantizer that fork can deadlock, and the child never exits.
        env = dict(os.environ, GGML_NO_BACKTRACE="1")
        try:
            proc = subprocess.run(module_command("clef_gguf.convert.quantize", str(spec_path)),
                                  capture_output=True, text=True, errors="replace", env=env,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ConversionError(f"llama.cpp did not finish quantizing to {name} within "
                                  f"{timeout:g} s; the quantizer was stopped") from None
        if proc.returncode != 0:
            raise _failure(name, proc)
        os.replace(partial, dst)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    kept = {"keep_layers": [dict(rule, tensors=keep_layers_mod.kept_tensors(keep, dst).get(
        f"{rule['layers']}={rule['type']}", {})) for rule in keep.rules()]} if keep else {}
    return {"outtype": name, "source_type": source_type, "seconds": round(time.perf_counter() - start, 3),
            "imatrix": im_meta or None, **{f"{k}_type": v.upper() for k, v in forced.items() if v},
            **kept, **tensor_types(dst)}


def tensor_types(path) -> dict:
    """``{"tensor_types": {type: count}, "output_weight": type}`` of a GGUF, for summaries."""
    from clef_gguf.formats.gguf import open_gguf

    counts: dict[str, int] = {}
    out = None
    for t in open_gguf(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        if t.name == "output.weight" or (t.name == "token_embd.weight" and out is None):
            out = t.tensor_type.name
    return {"tensor_types": dict(sorted(counts.items())), "output_weight": out}


def quantize_model(model_dir, out, outtype: str, *, name: str | None = None, **options) -> Path:
    """A converted f32/f16/bf16 model directory -> a new directory with the tower quantized."""
    from clef_gguf.formats import files

    model_dir, out = Path(model_dir), Path(out)
    outtype = canonical_outtype(outtype)
    found = files.from_directory(model_dir)
    manifest = files.read_manifest(model_dir) if (model_dir / files.MANIFEST).is_file() else {}
    tower = f"tower-{outtype}.gguf"
    with files.staged_directory(out) as stage:  # a failed quantization leaves no half directory
        quant = quantize_file(found.tower, stage / tower, outtype, **options)
        for role in ("head_weights", "head_config", "tokenizer"):
            path = getattr(found, role)
            shutil.copyfile(path, stage / path.name)
        roles = {"tower": tower, **{r: getattr(found, r).name for r in ("head_weights", "head_config",
                                                                         "tokenizer")}}
        source = {**manifest.get("source", {}), "quantized_from": str(found.tower.resolve()),
                  "quantization": quant}
        kept = {"finetune": manifest["finetune"]} if "finetune" in manifest else {}  # a merged fine-tune
        files.write_manifest(stage, name or manifest.get("name", found.name), outtype, roles,
                             extra={"source": source, **kept})
    return out


# --------------------------------------------------------------------------- the child process

def _child(spec: dict) -> int:
    import ctypes

    import llama_cpp as ll
    import numpy as np

    from clef_gguf.convert import imatrix_file as im

    ll.llama_backend_init()
    p = ll.llama_model_quantize_default_params()
    p.ftype, p.nthread = spec["ftype"], spec["threads"]
    if spec["output_type"] is not None:
        p.output_tensor_type = spec["output_type"]
    if spec["token_embedding_type"] is not None:
        p.token_embedding_type = spec["token_embedding_type"]
    keep: list[object] = []  # the arrays the C side points into must outlive the call
    items: list[tuple[str, str | int]] = []  # kv_overrides: written into the output's metadata
    if spec["imatrix"]:
        m = im.read(spec["imatrix"])
        arr = (ll.llama_model_imatrix_data * (len(m.entries) + 1))()  # zeroed: the terminator
        for i, (tname, values) in enumerate(m.entries.items()):
            values = np.ascontiguousarray(values, dtype=np.float32)
            name = tname.encode()
            keep += [values, name]
            arr[i].name, arr[i].size = name, values.size
            arr[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        p.imatrix = arr
        # The same provenance keys llama-quantize writes (tools/quantize/quantize.cpp).
        meta = spec["imatrix_meta"]
        items += [("quantize.imatrix.file", meta.get("file", "")),
                  ("quantize.imatrix.dataset", meta.get("dataset", "")),
                  ("quantize.imatrix.entries_count", int(meta.get("entries", len(m.entries)))),
                  ("quantize.imatrix.chunks_count", int(meta.get("chunks", 0)))]
    if spec.get("keep_layers"):
        kept = keep_layers_mod.KeepLayers({int(k): v for k, v in spec["keep_layers"].items()})
        items.append((keep_layers_mod.GGUF_KEY, kept.label()))
        planned = dry_run(ll, spec, p)
        if planned is None:
            return 3
        if not planned:  # a log format we do not know: say so rather than guess a mix
            print("error: llama.cpp's dry run listed no tensors: cannot place --keep-layers", file=sys.stderr)
            return 4
        pairs = keep_layers_mod.overrides(kept, planned)
        tt = (ll.llama_model_tensor_override * (len(pairs) + 1))()  # zeroed: the null terminator
        for slot, (pattern, kind) in zip(tt, pairs):
            encoded = pattern.encode()
            keep.append(encoded)
            slot.pattern, slot.type = encoded, ggml_type(kind)
        keep.append(tt)
        p.tt_overrides = tt
    if items:
        kv = (ll.llama_model_kv_override * (len(items) + 1))()
        for slot, (key, value) in zip(kv, items):
            slot.key = key.encode()
            if isinstance(value, int):
                slot.tag, slot.value.val_i64 = ll.LLAMA_KV_OVERRIDE_TYPE_INT, value
            else:
                slot.tag, slot.value.val_str = ll.LLAMA_KV_OVERRIDE_TYPE_STR, _c_string(value, 127)
        keep.append(kv)
        p.kv_overrides = kv
    rc = ll.llama_model_quantize(spec["src"].encode(), spec["dst"].encode(), ctypes.byref(p))
    return 0 if rc == 0 else 3


def dry_run(ll, spec: dict, p) -> dict[str, str] | None:
    """What the plain quantization gives each tensor (None if the dry run failed): llama.cpp's dry
    run (same parameters, no output file) logs it per tensor; the log still reaches stderr, where
    the parent reads failures."""
    import ctypes

    log: list[str] = []

    @ll.llama_log_callback
    def collect(level, text, user_data):
        chunk = text.decode("utf-8", "replace")
        log.append(chunk)
        sys.stderr.write(chunk)

    # The callback in place before (the tower's, which reads compute buffer sizes from the log, when
    # this runs in a process that also decodes: pick's probe, the tests) is put back after.
    before, before_data = ll.llama_log_callback(), ctypes.c_void_p()
    ll.llama_log_get(ctypes.byref(before), ctypes.byref(before_data))
    ll.llama_log_set(collect, ctypes.c_void_p(0))
    p.dry_run = True
    try:
        rc = ll.llama_model_quantize(spec["src"].encode(), spec["dst"].encode(), ctypes.byref(p))
    finally:
        p.dry_run = False
        ll.llama_log_set(before, before_data)
    return keep_layers_mod.planned_types("".join(log)) if rc == 0 else None


if __name__ == "__main__":
    sys.exit(_child(json.loads(Path(sys.argv[1]).read_text())))
