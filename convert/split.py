"""Native-clef GGUF (llama.cpp arch ``clef``, head inside) -> qwen35 tower GGUF + release head files.

``split_native(src, out)`` copies every tower tensor byte for byte (no re-quantization), renames the
``clef.*`` keys to ``qwen35.*``, drops the head's keys and tensors, and rebuilds
``joint_head.safetensors`` / ``joint_head_config.json`` in the release's names, undoing upstream's
folding of the three learned scalars, so ``heads.JointSchemaHead`` computes the reference's logits.
Each per-tensor undo step sits beside the row of the table below that it inverts.
Past 400 lines because of this docstring: the table and its sources stay beside the code that inverts them.

Upstream layout (R = routing_layers, i < R; L = layers, l < L; ``{p}`` = weight and bias)
--------------------------------------------------------------------------------------
================================================  =============================================  ======
release ``joint_head.safetensors`` name           native GGUF tensor                             undo
================================================  =============================================  ======
hidden_norm.{p}                                   decision.hidden_norm.{p}                       copy
<x>_projection.weight, x = memory, question,      decision.proj_<x>.weight                       copy
option_question, global, option_context, option_lexical
type_embedding.weight                             token_types.weight                             copy
option_summary_norm / field_norm / option_norm    decision.<same name>.{p}                       copy
residual_scorer.0.{p}                             decision.scorer.{p}      (older: cls.{p})      copy
residual_scorer.3.{p}                             decision.scorer_out.{p}  (older: cls.output.{p}) [1]
evidence_layers.i.query_norm / memory_norm        dec.blk.i.cross_attn_norm / cross_attn_norm_kv copy
evidence_layers.i.attention.in_proj_{p}           dec.blk.i.cross_attn_{q,k,v}.{p}               concat
evidence_layers.i.attention.out_proj              dec.blk.i.cross_attn_o                         copy
evidence_layers.i.feedforward_norm / .0 / .3      dec.blk.i.ffn_norm / ffn_up / ffn_down         copy
layers.l.norm1 / norm2 / norm3                    dec.blk.(R+l).attn_norm / cross_attn_norm /    copy
                                                  ffn_norm
layers.l.self_attn.in_proj_{p} / out_proj         dec.blk.(R+l).attn_{q,k,v}.{p} / attn_o        concat/copy
layers.l.multihead_attn.in_proj_{p} / out_proj    dec.blk.(R+l).cross_attn_{q,k,v}.{p} / _o      concat/copy
layers.l.linear1 / linear2                        dec.blk.(R+l).ffn_up / ffn_down                copy
prior_logit_scale θp, joint_logit_scale θj        decision.scales[0], [1] = exp(min(θ, ln 100))  ln
residual_gate θg                                  decision.scales[2] = sigmoid(θg)               logit
================================================  =============================================  ======

[1] copy; llama.cpp declares it ne {W, 1}: convert_hf_to_gguf.py writes [W, 1], a file rewritten by
llama-quantize may hold it 1-D ([W]); both read back as torch [1, W].

Keys: ``general.architecture = "clef"``, the qwen35 tower keys under ``clef.*`` (renamed back to
``qwen35.*``), and the head's ``clef.decision.type = "clef"`` (a string), ``.routing_block_count`` (R),
``.block_count`` (L), ``.head_count`` and ``clef.attention.layer_norm_epsilon`` (head LayerNorm eps,
1e-5). hidden_size / width / feedforward are no keys: they are the shapes of decision.hidden_norm,
decision.proj_memory and dec.blk.0.ffn_up, as llama.cpp's loader reads them. Every ``clef.decision.*``
key and the eps key are dropped (``temperature.<type>[.<bucket>]`` kept as a calibration file:
``split_calibration``); tokenizer keys (the ``systemone`` chat template included) are kept.

Folding: only the three scalars, into ``decision.scales`` (f32, computed in float64). clef.py passes
every other tensor through unchanged apart from the q/k/v split (``chunk(3, dim=0)``) and the +R
renumbering of ``layers``; nothing is multiplied into a weight. Undo: θ = ln(s) for both scales
(s = 100 means θ >= ln 100; ln 100 gives the same multiplier), θg = ln(s / (1 - s)); a saturated
s = 1 or 0 (|θg| > ~17 in f32) becomes ±40, whose sigmoid is again 1 or 0.

Sources (upstream files at the commits named; the layout they define is what this undoes):
  * ggml-org/llama.cpp conversion/clef.py @ ff15e5724b91673b846f43fa1ebe71ee6a68ba0b: ClefModel keys
    (add_decision_*, add_layer_norm_eps(1e-5)), ``joint_head.`` prefix, +R renumbering, q/k/v chunking,
    the folds, scales order (prior, joint, gate). Its opening matches the copy at docs.rs
    llama-cpp-native 0.32.0 llama.cpp/conversion/clef.py (only the opening was visible there).
  * ggml-org/llama.cpp src/models/clef.cpp @ 35b453769bbce9b9a28b2fa2e64b173635fc5c06: tensor shapes,
    eps from LLM_KV_ATTENTION_LAYERNORM_EPS, logit = prior*scales[0] + (cos*scales[1] + res)*scales[2].
  * ngpestelos-mirrors/llama.cpp (a mirror of llama.cpp) gguf-py/gguf/constants.py
    @ 4732881d3572f771ec71ce246683153e8c076846:
    Keys.Decision, TENSOR_NAMES (decision.*, dec.blk.{bid}.*, token_types, decision.scales/scorer/
    scorer_out, cls, cls.output), DecisionType.CLEF = "clef", MODEL_ARCH_NAMES[CLEF] = "clef".
  * same mirror, gguf-py/gguf/tensor_mapping.py and src/models/clef.cpp @
    aace2e501bbb397f7f7c3647dd612a3e839d3071: the joint_head.* -> MODEL_TENSOR map; this older
    revision maps residual_scorer.0/.3 to CLS/CLS_OUT and hard-codes the eps (no key).
  Confirmed in those sources: every name, key and fold above. Inferred: that published files use one
  of these two revisions; the 1-D scorer_out (ggml's n_dims rule; a third-party reader and a
  write-up of ggml-org/Clef-Flash-GGUF Q4_K_M report Q8_0 head matrices and a BF16 scorer_out);
  that a missing eps key means 1e-5 (what the older clef.cpp hard-codes).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from clef_gguf.formats import files
from clef_gguf.convert.gguf_tokenizer import tokenizer_from_gguf
from clef_gguf.convert.hf_to_gguf import stream_gguf
from clef_gguf.convert.split_calibration import upstream_temperatures, write_calibration
from clef_gguf.core.errors import ClefError, ConversionError, CorruptModel, ModelNotFound
from clef_gguf.formats.gguf import NATIVE_ARCH, TOWER_ARCH, field_value, file_type_name, open_gguf

DECISION_TYPE = "clef"
HEAD_NORM_EPS = 1e-5  # heads.JointSchemaHead uses torch's LayerNorm default
# Key suffixes (after "clef.") that belong to the head: the whole decision namespace and the eps.
HEAD_KEY_PREFIXES = ("decision.", "attention.layer_norm_epsilon")
# Config keys that are GGUF keys; the other three come from tensor shapes (see _config).
CONFIG_FROM_KEYS = {"routing_layers": "decision.routing_block_count",
                    "layers": "decision.block_count", "heads": "decision.head_count"}
# Tensor namespaces llama.cpp gives the head; anything here that the tables do not consume is refused.
HEAD_NAMESPACES = ("decision.", "dec.", "token_types.", "cls.")
SCALES = "decision.scales"

WB, W = ("weight", "bias"), ("weight",)
# (release module, upstream module aliases (first present wins), parameters, transform)
TOP_TABLE = (
    ("hidden_norm", ("decision.hidden_norm",), WB, "copy"),
    ("memory_projection", ("decision.proj_memory",), W, "copy"),
    ("question_projection", ("decision.proj_question",), W, "copy"),
    ("option_question_projection", ("decision.proj_option_question",), W, "copy"),
    ("global_projection", ("decision.proj_global",), W, "copy"),
    ("option_context_projection", ("decision.proj_option_context",), W, "copy"),
    ("option_lexical_projection", ("decision.proj_option_lexical",), W, "copy"),
    ("type_embedding", ("token_types",), W, "copy"),
    ("option_summary_norm", ("decision.option_summary_norm",), WB, "copy"),
    ("field_norm", ("decision.field_norm",), WB, "copy"),
    ("option_norm", ("decision.option_norm",), WB, "copy"),
    ("residual_scorer.0", ("decision.scorer", "cls"), WB, "copy"),
    ("residual_scorer.3", ("decision.scorer_out", "cls.output"), WB, "copy"),
)
# Per block: (module under evidence_layers.{i}. / layers.{i}., module under dec.blk.{b}., params,
# transform). "qkv" joins the three ``<module>_{q,k,v}`` tensors into torch's packed in_proj.
BlockTable = tuple[tuple[str, str, tuple[str, ...], str], ...]
ROUTING_TABLE: BlockTable = (
    ("query_norm", "cross_attn_norm", WB, "copy"),
    ("memory_norm", "cross_attn_norm_kv", WB, "copy"),
    ("attention.in_proj", "cross_attn", WB, "qkv"),
    ("attention.out_proj", "cross_attn_o", WB, "copy"),
    ("feedforward_norm", "ffn_norm", WB, "copy"),
    ("feedforward.0", "ffn_up", WB, "copy"),
    ("feedforward.3", "ffn_down", WB, "copy"),
)
DECODER_TABLE: BlockTable = (
    ("norm1", "attn_norm", WB, "copy"),
    ("self_attn.in_proj", "attn", WB, "qkv"),
    ("self_attn.out_proj", "attn_o", WB, "copy"),
    ("norm2", "cross_attn_norm", WB, "copy"),
    ("multihead_attn.in_proj", "cross_attn", WB, "qkv"),
    ("multihead_attn.out_proj", "cross_attn_o", WB, "copy"),
    ("norm3", "ffn_norm", WB, "copy"),
    ("linear1", "ffn_up", WB, "copy"),
    ("linear2", "ffn_down", WB, "copy"),
)


def _unfold_scale(s: float) -> float:
    # s = exp(min(θ, ln 100)); above 100 no θ gives it.
    if not 0.0 < s <= 100.0 * (1 + 1e-6):
        raise ConversionError(f"{SCALES} holds {s}, not a value of exp(min(θ, ln 100)) in (0, 100]")
    return math.log(min(s, 100.0))


def _unfold_gate(s: float) -> float:
    if not 0.0 <= s <= 1.0:
        raise ConversionError(f"{SCALES}[2] holds {s}, not a sigmoid value in [0, 1]")
    if s in (0.0, 1.0):  # saturated in f32: any large |θ| reproduces it, keep it finite
        return 40.0 if s == 1.0 else -40.0
    return math.log(s / (1.0 - s))


# (release scalar, index in decision.scales, inverse of upstream's fold)
SCALAR_TABLE = (
    ("prior_logit_scale", 0, _unfold_scale),
    ("joint_logit_scale", 1, _unfold_scale),
    ("residual_gate", 2, _unfold_gate),
)


def _mapping(routing: int, layers: int) -> list[tuple[str, tuple[str, ...], str]]:
    """Every release tensor name -> (upstream name candidates, transform), expanded from the tables."""
    rows = [(f"{rel}.{p}", tuple(f"{u}.{p}" for u in ups), how)
            for rel, ups, params, how in TOP_TABLE for p in params]
    blocks = [("evidence_layers", i, i, ROUTING_TABLE) for i in range(routing)]
    blocks += [("layers", i, routing + i, DECODER_TABLE) for i in range(layers)]
    for group, i, b, table in blocks:
        for rel, up, params, how in table:
            for p in params:
                name = f"{group}.{i}.{rel}_{p}" if how == "qkv" else f"{group}.{i}.{rel}.{p}"
                rows.append((name, (f"dec.blk.{b}.{up}.{p}",), how))
    return rows


# --------------------------------------------------------------------------- reading

def _open(src: Path) -> gguf.GGUFReader:
    if not src.is_file():
        raise ModelNotFound(f"native GGUF not found: {src}", field="src")
    try:
        reader = open_gguf(src, whole_arrays=True)  # the vocabulary is copied and rebuilt from it
    except CorruptModel as exc:  # the same reader as the runtime's; here it is a conversion input
        raise ConversionError(exc.message) from None
    arch = field_value(reader, "general.architecture")
    if arch != NATIVE_ARCH:
        hint = " (already a tower: load it directly)" if arch == TOWER_ARCH else ""
        raise ConversionError(f"{src.name} has architecture {arch!r}, not {NATIVE_ARCH!r}: "
                              f"only native-clef GGUFs can be split{hint}")
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise ConversionError(f"{src.name} is a big-endian GGUF; only little-endian files are split")
    if int(field_value(reader, "split.count") or 1) > 1:
        raise ConversionError(f"{src.name} is one shard of a split GGUF; merge the shards first "
                              "(llama-gguf-split --merge)")
    dtype = field_value(reader, f"{NATIVE_ARCH}.decision.type")
    if dtype is not None and dtype != DECISION_TYPE:
        raise ConversionError(f"{src.name} has {NATIVE_ARCH}.decision.type {dtype!r}, not {DECISION_TYPE!r}")
    return reader


def _ne(t) -> tuple[int, ...]:
    """A tensor's shape in torch order (ggml's ne reversed)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _config(reader: gguf.GGUFReader, tensors: dict) -> dict[str, int]:
    """The six constructor keys: three GGUF keys, three shapes (as llama.cpp's loader reads them)."""
    config: dict[str, int] = {}
    for name in ("decision.hidden_norm.weight", "decision.proj_memory.weight", "dec.blk.0.ffn_up.weight"):
        if name not in tensors:
            raise ConversionError(f"missing decision tensor {name!r}: the file carries no complete Clef head")
    config["hidden_size"] = _ne(tensors["decision.hidden_norm.weight"])[-1]
    config["width"] = _ne(tensors["decision.proj_memory.weight"])[0]
    for key, gkey in CONFIG_FROM_KEYS.items():
        value = field_value(reader, f"{NATIVE_ARCH}.{gkey}")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConversionError(f"key {NATIVE_ARCH}.{gkey} is missing or not an integer")
        config[key] = value
    config["feedforward"] = _ne(tensors["dec.blk.0.ffn_up.weight"])[0]
    order = ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward")
    config = {k: config[k] for k in order}
    from clef_gguf.heads import check_config  # torch-heavy; imported only when splitting
    try:
        check_config(config, source="the decision keys and shapes")
    except ClefError as exc:
        raise ConversionError(exc.message) from None
    n_embd = field_value(reader, f"{NATIVE_ARCH}.embedding_length")
    if n_embd is not None and n_embd != config["hidden_size"]:
        raise ConversionError(f"decision.hidden_norm has {config['hidden_size']} values but "
                              f"{NATIVE_ARCH}.embedding_length is {n_embd}")
    eps = field_value(reader, f"{NATIVE_ARCH}.attention.layer_norm_epsilon")
    if eps is not None and not math.isclose(eps, HEAD_NORM_EPS, rel_tol=1e-4):
        raise ConversionError(f"the head's LayerNorm eps is {eps}; the reference head uses {HEAD_NORM_EPS}")
    return config


def _as_f32(t) -> np.ndarray:
    try:
        return np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ConversionError(f"head tensor {t.name} is {t.tensor_type.name}, which gguf-py cannot "
                              "dequantize") from None


def _fit(name: str, array: np.ndarray, shape: tuple[int, ...], source: str) -> torch.Tensor:
    # Only dims of size 1 may differ (the scorer_out row), never the order of the others.
    if tuple(d for d in array.shape if d != 1) != tuple(d for d in shape if d != 1):
        raise ConversionError(f"{source} has shape {list(array.shape)}, but {name} needs {list(shape)} "
                              "for the head config read from the file")
    tensor = torch.from_numpy(array.reshape(shape).copy())
    if not bool(torch.isfinite(tensor).all()):
        raise ConversionError(f"{source} contains NaN or infinity")
    return tensor


def extract_head(reader: gguf.GGUFReader) -> tuple[dict, dict[str, torch.Tensor], set[str]]:
    """(config, release state dict in f32, upstream tensor names consumed)."""
    from clef_gguf.heads import JointSchemaHead

    tensors = {t.name: t for t in reader.tensors}
    config = _config(reader, tensors)
    with torch.device("meta"):  # shapes only, nothing allocated
        expected = {k: tuple(v.shape) for k, v in JointSchemaHead(**config).state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name, candidates, how in _mapping(config["routing_layers"], config["layers"]):
        present = [c for c in candidates if c in tensors]
        if len(present) > 1:
            raise ConversionError(f"both {present[0]!r} and {present[1]!r} are present: ambiguous {name}")
        if how == "qkv":
            stem, p = candidates[0].rsplit(".", 1)
            parts = [f"{stem}_{x}.{p}" for x in "qkv"]
            missing = [n for n in parts if n not in tensors]
            if missing:
                raise ConversionError(f"missing decision tensor {missing[0]!r} (for {name})")
            part_shape = (expected[name][0] // 3, *expected[name][1:])
            chunks = [_fit(name, _as_f32(tensors[n]), part_shape, n) for n in parts]
            state[name] = torch.cat(chunks, dim=0)  # torch packs rows as q, then k, then v
            used.update(parts)
        else:
            if not present:
                raise ConversionError(f"missing decision tensor {candidates[0]!r} (for {name})")
            state[name] = _fit(name, _as_f32(tensors[present[0]]), expected[name], present[0])
            used.add(present[0])
    if SCALES not in tensors:
        raise ConversionError(f"missing decision tensor {SCALES!r} (the three learned scalars)")
    scales = _as_f32(tensors[SCALES]).reshape(-1)
    if scales.size != len(SCALAR_TABLE):
        raise ConversionError(f"{SCALES} holds {scales.size} values, not {len(SCALAR_TABLE)}")
    for name, index, unfold in SCALAR_TABLE:
        state[name] = torch.tensor(unfold(float(scales[index])), dtype=torch.float32)
    used.add(SCALES)
    extra = sorted(n for n in tensors if n.startswith(HEAD_NAMESPACES) and n not in used)
    if extra:
        raise ConversionError(f"unexpected head tensor(s) for this config: {', '.join(extra[:5])}"
                              + (" ..." if len(extra) > 5 else ""))
    return config, {k: state[k] for k in expected}, used


# --------------------------------------------------------------------------- writing

def _field_value(field):
    """(value, type, sub_type) as GGUFWriter wants them; strings stay raw bytes (no re-encoding)."""
    main = field.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if not field.data:  # gguf-py's writer refuses empty arrays
            raise ConversionError(f"key {field.name} is an empty array, which gguf-py cannot write")
        if len(field.types) > 2:
            raise ConversionError(f"key {field.name} is a nested array, which this splitter does not copy")
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        return field.contents(), main, sub
    if main == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]), main, None
    return field.contents(), main, None


def tower_key(key: str) -> str | None:
    """The tower's name for a native key, or None for a head key that the tower must not carry."""
    if not key.startswith(NATIVE_ARCH + "."):
        return key
    rest = key[len(NATIVE_ARCH) + 1:]
    return None if rest.startswith(HEAD_KEY_PREFIXES) else f"{TOWER_ARCH}.{rest}"


def write_tower(reader: gguf.GGUFReader, path: Path, head_tensors: set[str]) -> tuple[int, list[str]]:
    """Copy keys (renamed) and every non-head tensor's bytes; returns (tensors, dropped keys)."""
    writer = gguf.GGUFWriter(path=None, arch=TOWER_ARCH)
    dropped = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the file header and the arch are the writer's own
        if key == "general.alignment":
            writer.add_custom_alignment(int(field.contents()))
            continue
        new = tower_key(key)
        if new is None:
            dropped.append(key)
            continue
        value, vtype, sub = _field_value(field)
        writer.add_key_value(new, value, vtype, sub_type=sub)
    tower = [t for t in reader.tensors if t.name not in head_tensors]
    for t in tower:
        # The reader's array is the stored bytes (uint8 byte-shape for quantized types); the writer
        # maps that back to the same ne, so data and dims are the file's own.
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
    stream_gguf(writer, path, (t.data for t in tower))
    return len(tower), dropped


def split_native(src, out, *, tokenizer=None, name: str | None = None, head_dtype: str = "f32") -> Path:
    """Split the native-clef GGUF ``src`` into the clef-gguf model directory ``out``; returns ``out``.

    See ``split_with_summary`` for the options.
    """
    return split_with_summary(src, out, tokenizer=tokenizer, name=name, head_dtype=head_dtype)[0]


def split_with_summary(src, out, *, tokenizer=None, name: str | None = None,
                       head_dtype: str = "f32") -> tuple[Path, dict]:
    """``split_native`` plus a summary of what was written (for the CLI).

    ``tokenizer``: a ``tokenizer.json`` to copy; without one it is rebuilt from the GGUF's own
    vocabulary (``gguf_tokenizer``), and a vocabulary that cannot be rebuilt exactly is refused.
    ``head_dtype``: "f32" keeps dequantized head values exactly; "bf16" is the release's dtype.
    Everything is written into a temporary directory beside ``out`` and moved there complete: a
    failed split leaves no ``out`` behind, and an existing ``out`` is touched only at the end.
    """
    src, out = Path(src), Path(out)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    if head_dtype not in dtypes:
        raise ConversionError(f"head_dtype must be one of {', '.join(dtypes)}")
    tokenizer = Path(tokenizer) if tokenizer is not None else None
    if tokenizer is not None and not tokenizer.is_file():
        raise ModelNotFound(f"tokenizer not found: {tokenizer}", field="tokenizer")
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out} exists and is not a directory")
    reader = _open(src)
    config, state, used = extract_head(reader)  # every check runs before anything is written
    temperatures = upstream_temperatures(reader, NATIVE_ARCH)
    rebuilt = tokenizer_from_gguf(reader) if tokenizer is None else None
    label = file_type_name(reader)
    tower = f"tower-{label}.gguf"
    name = name or field_value(reader, "general.name") or src.stem
    with files.staged_directory(out) as stage:
        n_tensors, dropped = write_tower(reader, stage / tower, used)
        save_file({k: v.to(dtypes[head_dtype]).contiguous() for k, v in state.items()},
                  str(stage / files.HEAD_WEIGHTS), metadata={"format": "pt"})
        (stage / files.HEAD_CONFIG).write_text(json.dumps(config, indent=2) + "\n",
                                               encoding="utf-8")
        if rebuilt is not None:
            rebuilt.save(str(stage / files.TOKENIZER))
        else:
            shutil.copyfile(tokenizer, stage / files.TOKENIZER)
        scalars = {k: float(state[k]) for k, _, _ in SCALAR_TABLE}
        source = {"path": str(src.resolve()), "format": "native-clef-gguf", "architecture": NATIVE_ARCH,
                  "tower_tensors": n_tensors, "head_tensors": len(used), "dropped_keys": dropped,
                  "head_scalars": scalars, "head_dtype": head_dtype,
                  "tokenizer": "gguf" if rebuilt is not None else str(tokenizer.resolve())}
        files.write_manifest(stage, str(name), label,
                             {"tower": tower, "head_weights": files.HEAD_WEIGHTS,
                              "head_config": files.HEAD_CONFIG, "tokenizer": files.TOKENIZER},
                             extra={"source": source})
        calibration = write_calibration(stage, temperatures, src.name)
    return out, {"model_dir": str(out), "tower": str(out / tower), "outtype": label,
                 "tower_tensors": n_tensors, "head_tensors": len(used), "dropped_keys": dropped,
                 "head_weights": str(out / files.HEAD_WEIGHTS),
                 "tokenizer": "rebuilt from the GGUF" if rebuilt is not None else "copied",
                 "manifest": (out / files.MANIFEST).is_file(), "calibration": calibration}


# --------------------------------------------------------------------------- CLI (wired by clef_gguf.cli)

def add_split_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="native-clef GGUF (llama.cpp architecture 'clef', head inside)")
    p.add_argument("out", help="output model directory (created if missing); temperatures != 1.0 "
                   "are kept there as calibration.json, for --calibration to apply them as llama.cpp does")
    p.add_argument("--tokenizer", help="tokenizer.json to copy (default: rebuilt from the GGUF's "
                   "own vocabulary; one that cannot be rebuilt exactly is refused)")
    p.add_argument("--name", help="model name in the manifest (default: the GGUF's general.name)")
    p.add_argument("--head-dtype", choices=("f32", "bf16"), default="f32",
                   help="storage type of joint_head.safetensors (default f32: exact)")


def run_split(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    _, summary = split_with_summary(args.src, args.out, tokenizer=args.tokenizer, name=args.name,
                                    head_dtype=args.head_dtype)
    summary["seconds"] = round(time.perf_counter() - start, 3)
    print(json.dumps(summary, indent=2))
    return 0
