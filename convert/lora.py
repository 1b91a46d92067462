"""A PEFT LoRA of a Clef release -> a fine-tune directory for a converted base (``convert_adapter``).

The input is a clef-finetune checkpoint (``adapter/`` with PEFT's ``adapter_config.json`` and
``adapter_model.safetensors``, ``joint_head.safetensors``, ``train_config.json``) or a bare PEFT
adapter directory plus a head file. The output, written all or nothing, is what
``clef_gguf.formats.finetune_files`` reads: the LoRA as a llama.cpp adapter GGUF for the base's ``qwen35``
tower, the fine-tune's head (float32), the base's head config and the manifest.

The GGUF holds ``blk.N.X.weight.lora_a`` (PEFT's A, [rank, in]) and ``.lora_b`` (B, [out, rank])
for each adapted base tensor ``blk.N.X.weight``: the tower converter's names, and its V-head
reordering applied to the side of B @ A it permutes (row edits to B's rows, column edits to A's
columns), so that B @ A is the converted weight's delta. Everything is checked against the base
GGUF before a byte is written: llama.cpp rejects a mismatching adapter only at load time.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from clef_gguf.formats import files
from clef_gguf.convert import tensor_map as tm
from clef_gguf.convert.hf_to_gguf import SUPPORTED, read_json, stream_gguf
from clef_gguf.core import errors
from clef_gguf.core.errors import AdapterMismatch, ConversionError, CorruptModel, ModelNotFound
from clef_gguf.formats.finetune_files import ADAPTER_FORMAT, ADAPTER_MANIFEST, adapter_file_name
from clef_gguf.heads.load import load_head
from clef_gguf.formats.gguf import TOWER_ARCH, array_length, open_gguf
from clef_gguf.formats.safetensors import opened, read_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAIN_CONFIG = "train_config.json"
# clef-finetune's checkpoint: the PEFT adapter one folder down, the head and training config beside.
CHECKPOINT_ADAPTER_DIR = "adapter"
OUTTYPES = tuple(tm.OUTTYPES)

# PEFT saves ``base_model.model.<module>.lora_A.weight``; the module is the release's (text-only
# bases have no ``language_model.``): the tower converter's prefixes, one home.
PEFT_PREFIX = "base_model.model."
MODULE_PREFIXES = tuple(sorted({prefix for _, prefix in SUPPORTED.values()}, key=len, reverse=True))
LORA_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])\.weight$")
# Which factor of W ~ B @ A each V-head reordering of W permutes: W's rows are B's, its columns A's.
# Edits missing here (plus_one, neg_exp, squeeze_conv) belong to tensors that are not linear maps.
EDIT_SIDE = {"tile_v_rows_of_qkv": "b", "tile_v_rows": "b", "tile_v_heads": "b", "tile_v_cols": "a"}
# PEFT settings that change what the adapter computes beyond W + scale * B @ A (truthy = refused).
UNSUPPORTED = {
    "use_dora": "DoRA (a learned magnitude per weight column)",
    "lora_bias": "LoRA biases",
    "trainable_token_indices": "trained token embeddings",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "layer_replication": "replicated layers",
    "target_parameters": "LoRA on bare parameters",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
}
_SOURCE_DTYPES = {"F32", "F16", "BF16"}


@dataclass
class Checkpoint:
    directory: Path
    adapter_dir: Path
    head: Path
    train_config: Path | None
    tool: str  # "clef-finetune" (its checkpoint layout) or "peft" (a bare adapter directory)


@dataclass
class Base:
    files: files.ModelFiles
    shapes: dict[str, tuple[int, ...]]  # GGUF tensor name -> ne (ggml order)
    dims: tm.Dims
    identity: dict


@dataclass
class Target:
    gguf_name: str  # the adapted base tensor
    a_name: str     # tensor names in the adapter file
    b_name: str
    edits: tuple[str, ...]
    rank: int
    scale: float    # PEFT's scale for this module
    a_type: gguf.GGMLQuantizationType
    b_type: gguf.GGMLQuantizationType


# --------------------------------------------------------------------------- inputs

def locate_checkpoint(checkpoint: Path, head: Path | None) -> Checkpoint:
    """The input's files: a clef-finetune checkpoint, or a bare PEFT directory (head from ``head``
    or beside it). ModelNotFound naming what is missing."""
    if not checkpoint.is_dir():
        raise ModelNotFound(f"checkpoint directory not found: {checkpoint}", field="checkpoint")
    nested = checkpoint / CHECKPOINT_ADAPTER_DIR
    adapter_dir, tool = (nested, "clef-finetune") if (nested / ADAPTER_CONFIG).is_file() \
        else (checkpoint, "peft")
    for fname in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter_dir / fname).is_file():
            raise ModelNotFound(f"no {fname} in {adapter_dir}: not a PEFT adapter (a clef-finetune "
                                f"checkpoint holds it in {CHECKPOINT_ADAPTER_DIR}/)", field="adapter")
    head = head if head is not None else checkpoint / files.HEAD_WEIGHTS
    if not head.is_file():
        raise ModelNotFound(f"head weights not found: {head} (a bare PEFT adapter needs --head FILE)",
                            field="head")
    train = checkpoint / TRAIN_CONFIG
    return Checkpoint(checkpoint, adapter_dir, head, train if train.is_file() else None, tool)


def read_adapter_config(path: Path) -> dict:
    """adapter_config.json, with every setting that would not survive as plain LoRA refused."""
    try:
        config = read_json(path)
    except ConversionError as exc:
        raise CorruptModel(exc.message, field="adapter") from None
    if config.get("peft_type") != "LORA":
        raise ConversionError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA; only LoRA "
                              f"adapters convert", field="adapter")
    used = [what for key, what in UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        used.append(f"trained biases (bias={config['bias']!r})")
    if used:
        raise ConversionError(f"{path} uses {', '.join(used)}: llama.cpp applies plain LoRA "
                              f"(W + scale * B @ A) only", field="adapter")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 \
            or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise CorruptModel(f"{path} needs an integer r >= 1 and a numeric lora_alpha", field="adapter")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise CorruptModel(f"{path}: {key} must be an object", field="adapter")
    return config


def _pattern(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern/alpha_pattern lookup: the first key matching a dotted suffix of the
    module name (``peft.utils.other.get_pattern_key``)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_base(base: Path) -> Base:
    """The converted model directory whose GGUF tower the adapter is for: tensor shapes, the
    dimensions the V-head reordering needs, and its identity for the manifest."""
    found = files.from_directory(base)
    if found.backend != "gguf" or found.tower.suffix != ".gguf":
        raise AdapterMismatch(f"{base} has no GGUF tower: LoRA adapters run on llama.cpp towers only",
                              field="base")
    reader = open_gguf(found.tower, field="base")

    def meta(key: str) -> Any:
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    arch = meta("general.architecture")
    if arch != TOWER_ARCH:
        raise AdapterMismatch(f"the base tower {found.tower.name} has architecture {arch!r}, "
                              f"adapters convert for {TOWER_ARCH!r} only", field="base")
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    k = lambda key: meta(f"{TOWER_ARCH}.{key}")  # noqa: E731
    # A key missing (None: TypeError), or not the type it should be.
    with errors.mapped(dict.fromkeys((KeyError, TypeError, ValueError), CorruptModel), field="base",
                       what=f"{found.tower} lacks the qwen35 settings an adapter needs"):
        state = int(k("ssm.state_size"))
        dims = tm.Dims(hidden=int(k("embedding_length")), ffn=int(k("feed_forward_length")),
                       vocab=int(array_length(reader, "tokenizer.ggml.tokens")),  # type: ignore[arg-type]
                       heads=int(k("attention.head_count")), kv_heads=int(k("attention.head_count_kv")),
                       head_dim=int(k("attention.key_length")), lin_k_heads=int(k("ssm.group_count")),
                       lin_v_heads=int(k("ssm.time_step_rank")), lin_k_dim=state, lin_v_dim=state,
                       conv_kernel=int(k("ssm.conv_kernel")),
                       layer_types=["linear_attention" if r else "full_attention"
                                    for r in k("attention.recurrent_layers")])
        n_layer = int(k("block_count"))
    identity = {"name": found.name, "tower": found.tower.name,
                "tower_sha256": found.sha256_of(found.tower), "architecture": TOWER_ARCH,
                "n_embd": dims.hidden, "n_layer": n_layer, "n_vocab": dims.vocab}
    return Base(found, shapes, dims, identity)


def scan_adapter(path: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) from the safetensors header; CorruptModel naming the file."""
    header = read_header(path, field="adapter", kind="adapter weights")
    return {name: (list(info.shape), info.dtype) for name, info in header.items()}


# --------------------------------------------------------------------------- planning

def _text_name(module: str) -> str | None:
    """``model.language_model.layers.3.mlp.up_proj`` -> ``layers.3.mlp.up_proj.weight``."""
    for prefix in MODULE_PREFIXES:
        if module.startswith(prefix):
            return module[len(prefix):] + ".weight"
    return None


def _target_gguf_name(module: str, base: Base) -> tuple[str, tuple[str, ...]]:
    """The base tensor a LoRA module adapts; AdapterMismatch when the tower has no such linear map."""
    text = _text_name(module)
    why = "only the linear projections of the language model's decoder layers take a LoRA here"
    if text is not None and text.startswith("layers."):
        try:
            gg, edits = tm.gguf_name(text)
        except ConversionError:
            why = "no Qwen3.5 decoder layer has this module (another architecture's name?)"
        else:
            if any(e not in EDIT_SIDE for e in edits):
                why = "it is not a linear projection (norms, the conv kernel and the decay " \
                      "parameters take no LoRA)"
            elif gg not in base.shapes:
                why = f"the base tower has no {gg} (another layer layout: the other attention " \
                      f"kind in that layer, or more layers)"
            else:
                return gg, edits
    raise AdapterMismatch(f"LoRA target {module!r} is not in the base tower: {why}", field="adapter")


def plan_targets(config: dict, found: dict[str, tuple[list[int], str]], base: Base,
                 outtype: str) -> tuple[list[Target], float]:
    """Pair every lora_A with its lora_B, map it to a base tensor and check shapes. Returns the
    targets and the alpha the GGUF carries (PEFT's lora_alpha when llama.cpp's alpha / rank
    reproduces every module's scale, else 0 with the scales folded into B)."""
    pairs: dict[str, dict[str, str]] = {}
    for name in found:
        m = LORA_TENSOR.match(name)
        if not m or not name.startswith(PEFT_PREFIX):
            what = "a trained copy of a whole module (modules_to_save)" if "modules_to_save" in name \
                else "not a LoRA A/B matrix"
            raise AdapterMismatch(f"adapter tensor {name!r} is {what}: only LoRA on the tower's "
                                  f"linear projections converts", field="adapter")
        module = m.group("module")[len(PEFT_PREFIX):]
        pairs.setdefault(module, {})[m.group("side").lower()] = name
    if not pairs:
        raise ConversionError("the adapter holds no LoRA tensors", field="adapter")
    rslora = bool(config.get("use_rslora"))
    mapped = {module: _target_gguf_name(module, base) for module in pairs}
    targets: list[Target] = []
    alphas = set()
    # In the tower's order: the first mismatch reported is the first tensor that mismatches.
    for module in sorted(mapped, key=lambda m: tm.sort_key(str(_text_name(m)))):
        sides, (gg, edits) = pairs[module], mapped[module]
        if set(sides) != {"a", "b"}:
            lacking = "lora_B" if "b" not in sides else "lora_A"
            raise CorruptModel(f"LoRA module {module!r} has no {lacking}", field="adapter")
        (a_shape, a_dtype), (b_shape, b_dtype) = found[sides["a"]], found[sides["b"]]
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise CorruptModel(f"LoRA module {module!r}: A {a_shape} and B {b_shape} are not "
                               f"[rank, in] and [out, rank]", field="adapter")
        if {a_dtype, b_dtype} - _SOURCE_DTYPES:
            raise ConversionError(f"LoRA module {module!r} is {a_dtype}/{b_dtype}; only f32/f16/bf16 "
                                  f"convert", field="adapter")
        ne = base.shapes[gg]
        if (ne[0], ne[1]) != (a_shape[1], b_shape[0]):
            raise AdapterMismatch(
                f"LoRA target {module!r} is [{b_shape[0]}, {a_shape[1]}] (out, in), but the base "
                f"tower's {gg} is [{ne[1]}, {ne[0]}]: the adapter was trained on another model size",
                field="adapter")
        rank = a_shape[0]
        expected_rank = _pattern(config.get("rank_pattern") or {}, module, config["r"])
        if rank != expected_rank:
            raise CorruptModel(f"LoRA module {module!r} has rank {rank}, adapter_config says "
                               f"{expected_rank}", field="adapter")
        alpha = float(_pattern(config.get("alpha_pattern") or {}, module, config["lora_alpha"]))
        alphas.add(alpha)
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        targets.append(Target(gg, sides["a"], sides["b"], edits, rank, scale,
                              tm.storage_type(gg, a_shape, outtype), tm.storage_type(gg, b_shape, outtype)))
    # llama.cpp scales a pair by alpha / rank, rank = lora_b's ne[0] (per tensor), and by 1 when alpha = 0.
    uniform = len(alphas) == 1 and not rslora and 0.0 not in alphas
    return targets, (alphas.pop() if uniform else 0.0)


# --------------------------------------------------------------------------- writing

def _payloads(path: Path, targets: list[Target], dims: tm.Dims, fold: bool,
              skip: frozenset[str]) -> Iterator[np.ndarray]:
    with contextlib.ExitStack() as stack:
        weights = stack.enter_context(opened(path, field="adapter", kind="adapter weights"))
        for t in targets:
            a = weights.tensor(t.a_name, check_finite=True).to(torch.float32)
            b = weights.tensor(t.b_name, check_finite=True).to(torch.float32)
            for edit in t.edits:
                if edit in skip:
                    continue
                if EDIT_SIDE[edit] == "a":
                    a = tm.EDITS[edit](a, dims)
                else:
                    b = tm.EDITS[edit](b, dims)
            if fold:
                b = b * t.scale
            yield tm.encode(a.numpy(), t.a_type)
            yield tm.encode(b.numpy(), t.b_type)


def write_adapter_gguf(path: Path, weights: Path, targets: list[Target], base: Base, alpha: float,
                       *, name: str, outtype: str, skip: frozenset[str] = frozenset()) -> None:
    writer = gguf.GGUFWriter(path=None, arch=TOWER_ARCH)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    writer.add_string("general.name", name)
    writer.add_uint32("general.file_type", int(tm.OUTTYPES[outtype][1]))
    writer.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    for t in targets:
        ne = base.shapes[t.gguf_name]
        for suffix, shape, qtype in ((".lora_a", [t.rank, ne[0]], t.a_type),
                                     (".lora_b", [ne[1], t.rank], t.b_type)):
            layout_shape, dtype, nbytes = tm.encoded_layout(shape, qtype)
            writer.add_tensor_info(t.gguf_name + suffix, layout_shape, dtype, nbytes, raw_dtype=qtype)
    stream_gguf(writer, path, _payloads(weights, targets, base.dims, fold=alpha == 0.0, skip=skip))


def convert_adapter(checkpoint: str | Path, out: str | Path, *, base: str | Path, outtype: str = "f16",
                    name: str | None = None, head: str | Path | None = None,
                    _skip_edits: frozenset[str] = frozenset()) -> Path:
    """Convert a clef-finetune checkpoint (or a PEFT adapter + ``head``) for the converted model
    directory ``base`` into the fine-tune directory ``out``; returns ``out``. ``_skip_edits``
    exists only for negative tests."""
    if outtype not in tm.OUTTYPES:
        raise ConversionError(f"unknown adapter outtype {outtype!r}; choose one of {', '.join(OUTTYPES)}",
                              field="outtype")
    ckpt = locate_checkpoint(Path(checkpoint), Path(head) if head is not None else None)
    out = Path(out)
    if (out / files.MANIFEST).is_file():
        raise ConversionError(f"{out} is a model directory ({files.MANIFEST}); write the fine-tune "
                              f"to a directory of its own", field="out")
    config = read_adapter_config(ckpt.adapter_dir / ADAPTER_CONFIG)
    based = read_base(Path(base))
    weights = ckpt.adapter_dir / ADAPTER_WEIGHTS
    targets, alpha = plan_targets(config, scan_adapter(weights), based, outtype)
    # The head must fit the base's config and tower; load_head raises HeadMismatch/CorruptModel.
    head_module = load_head(based.files.head_config, ckpt.head, hidden_size=based.dims.hidden)
    train_config = read_json(ckpt.train_config) if ckpt.train_config else None
    name = name or ckpt.directory.resolve().name
    adapter = adapter_file_name(outtype)
    with files.staged_directory(out) as stage:
        write_adapter_gguf(stage / adapter, weights, targets, based, alpha, name=name, outtype=outtype,
                           skip=_skip_edits)
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in head_module.state_dict().items()}
        save_file(state, str(stage / files.HEAD_WEIGHTS), metadata={"format": "pt"})
        shutil.copyfile(based.files.head_config, stage / files.HEAD_CONFIG)
        listed = {f: {"sha256": files.sha256_file(stage / f), "size": (stage / f).stat().st_size}
                  for f in (adapter, files.HEAD_WEIGHTS, files.HEAD_CONFIG)}
        manifest = {
            "format": ADAPTER_FORMAT, "name": name, "adapter": adapter,
            "head_weights": files.HEAD_WEIGHTS, "head_config": files.HEAD_CONFIG,
            "base": based.identity,
            "lora": {"rank": max(t.rank for t in targets), "alpha": alpha, "targets": len(targets),
                     "outtype": outtype},
            "source": {"checkpoint": str(ckpt.directory.resolve()), "tool": ckpt.tool,
                       "base_model": config.get("base_model_name_or_path"),
                       "train_config": train_config},
            "files": listed,
        }
        (stage / ADAPTER_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out
