"""Reading a vision tower's config and weights, from a converted model directory or a release.

A converted directory holds ``vision_config.json`` (the release's ``vision_config``, verbatim) and
``vision.safetensors`` (the release's ``model.visual.*`` tensors with the prefix stripped, as stored). A
Hugging Face release is read in place: ``config.json``'s ``vision_config`` and only the vision tensors of
its ``model*.safetensors`` (headers first, then just those tensors). Every way these files can be wrong is a
``ModelNotFound`` or ``CorruptModel`` with field ``vision``, never a traceback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch

from clef_gguf.core import errors
from clef_gguf.core.errors import CorruptModel, ModelNotFound
from clef_gguf.formats.files import SAFETENSORS_INDEX, VISION_CONFIG, VISION_WEIGHTS
from clef_gguf.formats.files import VISION_PREFIXES as PREFIXES
from clef_gguf.formats.safetensors import opened
from clef_gguf.vision.model import ACTIVATIONS, VisionConfig, VisionModel, rope_inv_freq

FIELD = "vision"
RELEASE_CONFIG = "config.json"
SIZE_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
             "spatial_merge_size", "in_channels", "num_position_embeddings", "out_hidden_size")
# Far above any release tower (the 9B: 27 blocks, 1152 wide, 2304 positions).
MAX_SIZE, MAX_DEPTH = 1 << 16, 256
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CONV_WEIGHT = "patch_embed.proj.weight"
# ValueError: not UTF-8 or not JSON; RecursionError: nested past Python's stack.
JSON_ERRORS: dict[type[BaseException], type[errors.ClefError]] = {
    OSError: CorruptModel, ValueError: CorruptModel, RecursionError: CorruptModel}


def _bad(message: str) -> CorruptModel:
    return CorruptModel(message, field=FIELD)


def _int(raw: Mapping, key: str, source: str) -> int:
    value = raw.get(key)
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]  # patch sizes may be written as [p, p]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{source}: {key} must be an integer, got {value!r}")
    most = MAX_DEPTH if key == "depth" else MAX_SIZE
    if not 1 <= value <= most:
        raise _bad(f"{source}: {key} must be in 1..{most}, got {value}")
    return value


def parse_config(raw: object, source: str = VISION_CONFIG) -> VisionConfig:
    """A release's ``vision_config`` as a checked ``VisionConfig``."""
    if not isinstance(raw, Mapping):
        raise _bad(f"{source} must hold a JSON object, got {type(raw).__name__}")
    sizes = {key: _int(raw, key, source) for key in SIZE_KEYS}
    act = raw.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise _bad(f"{source}: hidden_act {act!r} is not one of {', '.join(ACTIVATIONS)}")
    if raw.get("deepstack_visual_indexes"):
        raise _bad(f"{source}: deepstack_visual_indexes {raw['deepstack_visual_indexes']!r}: deepstack "
                   f"towers are not Qwen3.5's")
    rope = raw.get("rope_parameters") or {}
    if not isinstance(rope, Mapping) or rope.get("rope_type", "axial") != "axial":
        raise _bad(f"{source}: rope_parameters {rope!r}: only the axial vision RoPE is supported")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10_000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
        raise _bad(f"{source}: rope_theta must be a number > 1, got {theta!r}")
    config = VisionConfig(**sizes, hidden_act=act, rope_theta=float(theta))
    if config.hidden_size % config.num_heads or config.head_dim % 4:
        raise _bad(f"{source}: hidden_size {config.hidden_size} over {config.num_heads} heads must give a "
                   f"head size divisible by 4 (the 2-D RoPE's row and column halves)")
    if config.grid_side ** 2 != config.num_position_embeddings:
        raise _bad(f"{source}: num_position_embeddings {config.num_position_embeddings} is not a square grid")
    return config


def expected_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name (prefix stripped) -> shape, as the release stores it (the patch kernel as a Conv3d)."""
    D, inner, merged = c.hidden_size, c.intermediate_size, c.merged_dim
    shapes: dict[str, tuple[int, ...]] = {
        CONV_WEIGHT: (D, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size),
        "patch_embed.proj.bias": (D,),
        "pos_embed.weight": (c.num_position_embeddings, D),
    }
    for i in range(c.depth):
        shapes |= {f"blocks.{i}.{name}": shape for name, shape in {
            "norm1.weight": (D,), "norm1.bias": (D,), "norm2.weight": (D,), "norm2.bias": (D,),
            "attn.qkv.weight": (3 * D, D), "attn.qkv.bias": (3 * D,),
            "attn.proj.weight": (D, D), "attn.proj.bias": (D,),
            "mlp.linear_fc1.weight": (inner, D), "mlp.linear_fc1.bias": (inner,),
            "mlp.linear_fc2.weight": (D, inner), "mlp.linear_fc2.bias": (D,)}.items()}
    return shapes | {
        "merger.norm.weight": (D,), "merger.norm.bias": (D,),
        "merger.linear_fc1.weight": (merged, merged), "merger.linear_fc1.bias": (merged,),
        "merger.linear_fc2.weight": (c.out_hidden_size, merged), "merger.linear_fc2.bias": (c.out_hidden_size,),
    }


def _read_json(path: Path) -> object:
    if not path.is_file():
        raise ModelNotFound(f"vision config not found: {path}", field=FIELD)
    with errors.mapped(JSON_ERRORS, field=FIELD, what=f"cannot read {path}"):
        return json.loads(path.read_bytes().decode("utf-8"))


def _names(items: list[str]) -> str:
    return ", ".join(items[:5]) + (f" ... and {len(items) - 5} more" if len(items) > 5 else "")


def read_tensors(sources: Mapping[str, tuple[Path, str]], config: VisionConfig) -> dict[str, torch.Tensor]:
    """Read the tensors ``sources`` names (stripped name -> (file, stored name)) after checking the names and
    shapes against ``config``; dtype and finiteness checked as read."""
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(sources))
    unexpected = sorted(set(sources) - set(expected))
    if missing or unexpected:
        parts = ([f"missing {_names(missing)}"] if missing else []) + \
                ([f"unexpected {_names(unexpected)}"] if unexpected else [])
        raise _bad(f"the vision weights do not fit the vision config: {'; '.join(parts)}")
    by_file: dict[Path, list[str]] = {}
    for name, (path, _) in sources.items():
        by_file.setdefault(path, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with opened(path, field=FIELD, kind="vision weights") as weights:
            for name in names:
                stored = sources[name][1]
                shape = weights.info(stored).shape
                if shape != expected[name]:
                    raise _bad(f"{path.name}: {stored} has shape {list(shape)}, the vision config needs "
                               f"{list(expected[name])}")
                tensors[name] = weights.tensor(stored, check_finite=True)
    for name, tensor in tensors.items():
        if tensor.dtype not in WEIGHT_DTYPES:
            raise _bad(f"vision tensor {name} has dtype {tensor.dtype}, expected bf16, f16 or f32")
    return tensors


def _header(path: Path, kind: str) -> list[str]:
    with opened(path, field=FIELD, kind=kind) as weights:
        return weights.names()


def file_sources(config_path: Path, weights: Path) -> tuple[VisionConfig, dict[str, tuple[Path, str]]]:
    """The config and tensor sources of a ``vision_config.json`` + ``vision.safetensors`` pair."""
    config = parse_config(_read_json(config_path), source=config_path.name)
    return config, {name: (weights, name) for name in _header(weights, "vision weights")}


def release_config(directory: Path) -> dict | None:
    """The ``vision_config`` object of a release's ``config.json``; None when the release has none."""
    raw = _read_json(directory / RELEASE_CONFIG)
    vision = raw.get("vision_config") if isinstance(raw, dict) else None
    if vision is not None and not isinstance(vision, dict):
        raise _bad(f"{directory / RELEASE_CONFIG}: vision_config must be an object")
    return vision


def _release_files(directory: Path) -> list[Path]:
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = _read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise _bad(f"{index} has no weight_map of tensor -> file")
        names = {file for name, file in weight_map.items() if name.startswith(PREFIXES)}
        if any(Path(name).name != name for name in names):  # a shard is a file beside the index
            raise _bad(f"{index} names weight files outside its directory")
        return [directory / name for name in sorted(names)]
    return sorted(directory.glob("model*.safetensors"))


def release_sources(directory: Path) -> dict[str, tuple[Path, str]]:
    """Stripped name -> (shard, stored name) of every vision tensor in a release (headers only)."""
    found: dict[str, tuple[Path, str]] = {}
    for path in _release_files(directory):
        for stored in _header(path, "weight shard"):
            prefix = next((p for p in PREFIXES if stored.startswith(p)), None)
            if prefix is None:
                continue
            name = stored[len(prefix):]
            if name in found:
                raise _bad(f"vision tensor {name} appears twice ({found[name][0].name}: {found[name][1]}, "
                           f"{path.name}: {stored})")
            found[name] = (path, stored)
    return found


def sources(source: Path) -> tuple[VisionConfig, dict[str, tuple[Path, str]]]:
    """A converted directory (it has ``vision_config.json``) or a release directory (``config.json``)."""
    if not source.is_dir():
        raise ModelNotFound(f"vision tower directory not found: {source}", field=FIELD)
    if (source / VISION_CONFIG).is_file() or (source / VISION_WEIGHTS).is_file():
        return file_sources(source / VISION_CONFIG, source / VISION_WEIGHTS)
    if not (source / RELEASE_CONFIG).is_file():
        raise ModelNotFound(f"{source} has neither {VISION_CONFIG} (a converted model) nor "
                            f"{RELEASE_CONFIG} (a release)", field=FIELD)
    raw = release_config(source)
    if raw is None:
        raise ModelNotFound(f"{source / RELEASE_CONFIG} has no vision_config: a text-only release", field=FIELD)
    return parse_config(raw, source=f"{RELEASE_CONFIG} vision_config"), release_sources(source)


def build(config: VisionConfig, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> VisionModel:
    """The module with ``tensors`` (release names and shapes) adopted, cast to ``dtype``, in eval mode."""
    with torch.device("meta"):
        model = VisionModel(config)
    state = dict(tensors)
    state[CONV_WEIGHT] = state[CONV_WEIGHT].reshape(config.hidden_size, config.patch_dim)
    model.load_state_dict({name: t.to(dtype) for name, t in state.items()}, strict=True, assign=True)
    # The RoPE frequencies are not weights: meta after construction, computed again here.
    model.inv_freq = rope_inv_freq(config)
    model.requires_grad_(False)
    return model.eval()
