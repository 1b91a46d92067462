"""Quantize a Hugging Face Clef release to NVFP4: a compressed-tensors checkpoint directory.

``quantize_release(src, out, scheme="nvfp4a16" | "nvfp4")`` writes what llm-compressor would for the
27B recipe (docs/design/nvfp4.md §2): every Linear of the text decoder layers (attention q/k/v/o, MLP gate/up/down,
GDN in_proj_qkv/in_proj_z/out_proj) becomes ``weight_packed`` / ``weight_scale`` /
``weight_global_scale`` (+ ``input_global_scale`` for W4A4); everything else is copied byte for byte
(embeddings, lm_head, whose rows the head reads as option vectors, norms, the GDN gates and
convolution, the vision tower, the MTP block). Layers fused at run time share their global scales
(the smallest of the group, as llm-compressor fuses them), so one decode scale serves the fused GEMM.

W4A4 needs a static activation global scale per layer: the release runs in fp32 through transformers
over a few requests in Clef's prompt format, and each layer's input amax sets it.

Tensors stream one at a time into output shards of bounded size; all files appear at once, or none.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from clef_gguf.convert.release import PROCESSOR_FILES
from clef_gguf.core import errors
from clef_gguf.core.deps import need
from clef_gguf.core.limits import GB
from clef_gguf.formats import files
from clef_gguf.formats.safetensors import Tensors
from clef_gguf.convert.hf_to_gguf import SUPPORTED, load_config, open_weights, read_json, scan_checkpoint
from clef_gguf.tower.nvfp4 import format as fmt
from clef_gguf.tower.nvfp4.checkpoint import COMPRESSION

SCHEMES = ("nvfp4a16", "nvfp4")
# Our scheme name -> compressed-tensors' preset (its args are what llm-compressor writes).
PRESETS = {"nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4"}
ACTIVATIONS = {"nvfp4a16": False, "nvfp4": True}
TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_SHARD_BYTES = 5 * GB  # one shard is what the writer holds in memory at a time
# The quantized Linear layers of one decoder layer, grouped as they are fused at run time.
FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",),
                ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"), ("linear_attn.out_proj",))
_GROUP_OF = {part: i for i, group in enumerate(FUSED_GROUPS) for part in group}
# Linear layers the "Linear" target would also catch, kept in bf16 (names under the
# Qwen3_5ForConditionalGeneration root; ignore wins over targets).
IGNORE = ("lm_head", "re:.*visual.*", "re:.*mtp.*", r"re:.*linear_attn\.in_proj_[ab]$")
_QUANTIZABLE = ("BF16", "F16", "F32")
# Bytes per element of each safetensors dtype, to size shards before any tensor is read.
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass
class Target:
    """One Linear weight to quantize."""

    module: str  # checkpoint name without ".weight"
    group: tuple[str, int]  # (layer prefix, fused group): members share their global scales
    shape: tuple[int, int]
    weight_global_scale: torch.Tensor | None = None  # fp32 [1], shared over the group
    input_global_scale: torch.Tensor | None = None  # fp32 [1], W4A4 only, shared over the group


def _target_pattern(prefix: str) -> re.Pattern[str]:
    parts = "|".join(re.escape(part) for part in _GROUP_OF)
    return re.compile(rf"^({re.escape(prefix)}layers\.\d+\.)({parts})\.weight$")


def is_target(name: str, prefix: str) -> bool:
    """Whether the checkpoint tensor ``name`` is a weight this conversion quantizes (``prefix``: the text
    model's, ``hf_to_gguf.SUPPORTED``): the speed probe plans the same tensors NVFP4
    (``convert.probe_tower.nvfp4_retyped``)."""
    return _target_pattern(prefix).match(name) is not None


def find_targets(found: dict, prefix: str) -> dict[str, Target]:
    """checkpoint name of each weight to quantize -> its Target; shapes checked."""
    pattern = _target_pattern(prefix)
    targets = {}
    for name, (_, shape, dtype) in found.items():
        match = pattern.match(name)
        if not match:
            continue
        if len(shape) != 2 or shape[1] % fmt.GROUP or dtype not in _QUANTIZABLE:
            raise errors.ConversionError(f"{name} is {dtype} {shape}; NVFP4 needs a {'/'.join(_QUANTIZABLE)} "
                                         f"matrix whose input dimension is a multiple of {fmt.GROUP}")
        targets[name] = Target(module=name[:-len(".weight")], group=(match[1], _GROUP_OF[match[2]]),
                               shape=(shape[0], shape[1]))
    if not targets:
        raise errors.ConversionError(f"no decoder-layer Linear weights under {prefix}layers. to quantize")
    return targets


def _shared(targets: Iterable[Target], scale_of) -> Iterator[tuple[Target, torch.Tensor]]:
    """Give every member of a fused group the smallest of the group's scales (``scale_of(t)``)."""
    groups: dict[tuple, list[Target]] = {}
    for t in targets:
        groups.setdefault(t.group, []).append(t)
    for members in groups.values():
        shared = torch.stack([scale_of(t) for t in members]).min(dim=0).values
        for t in members:
            yield t, shared.clone()  # one tensor each: safetensors refuses tensors sharing memory


class _Reader:
    """Tensors of a checkpoint by name, each file opened once."""

    def __init__(self, stack: contextlib.ExitStack, found: dict[str, tuple[Path, list[int], str]]) -> None:
        self.found, self.stack = found, stack
        self.handles: dict[Path, Tensors] = {}

    def tensor(self, name: str) -> torch.Tensor:
        path = self.found[name][0]
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(open_weights(path))
        return self.handles[path].tensor(name)


# --------------------------------------------------------------------------- calibration (W4A4)

def default_requests() -> list[dict]:
    from clef_gguf.convert.samples import SAMPLE_REQUESTS

    return list(SAMPLE_REQUESTS)


def calibrate(src: Path, arch: str, modules: list[str], requests: list[dict]) -> tuple[dict[str, torch.Tensor], int]:
    """Input amax of each named Linear over the prompts of ``requests``, running the release in fp32
    through transformers. Returns (module -> fp32 amax, tokens seen)."""
    from clef_gguf.pipeline.encode import Encoder
    from clef_gguf.pipeline.request import parse_request

    transformers = need("transformers", "nvfp4", what="W4A4 calibration runs the release through transformers")
    if not requests:
        raise errors.ConversionError("W4A4 calibration needs at least one request", field="calibration")
    encoder = Encoder.from_file(src / files.TOKENIZER)
    prompts = []
    for i, request in enumerate(requests):
        try:
            prompts.append(torch.as_tensor(encoder.encode(parse_request(request)).ids, dtype=torch.long))
        except errors.ClefError as exc:
            raise errors.ConversionError(f"calibration request {i}: {exc.message}", field="calibration") from None
    model = getattr(transformers, arch).from_pretrained(src, dtype=torch.float32).eval()
    text_model = getattr(model.model, "language_model", model.model)
    amax: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(_module, args):
            seen = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax[name], seen) if name in amax else seen
        return hook

    hooks = []
    try:
        for name in modules:
            try:
                hooks.append(model.get_submodule(name).register_forward_pre_hook(record(name)))
            except AttributeError:
                raise errors.ConversionError(f"{name} is not a module of transformers' {arch}") from None
        with torch.inference_mode():
            for ids in prompts:
                text_model(input_ids=ids[None], use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    unseen = [name for name in modules if name not in amax]
    if unseen:
        raise errors.ConversionError(f"calibration never ran {', '.join(unseen[:3])}", field="calibration")
    return amax, sum(len(ids) for ids in prompts)


# --------------------------------------------------------------------------- config

def quantization_config(scheme: str) -> dict:
    """config.json's ``quantization_config``, built and dumped by compressed-tensors' own models
    the way its ModelCompressor writes it."""
    why = "writing an NVFP4 checkpoint needs compressed-tensors"
    compressed_tensors = need("compressed_tensors", "nvfp4", what=why)
    quantization = need("compressed_tensors.quantization", "nvfp4", what=why)
    presets = need("compressed_tensors.quantization.quant_scheme", "nvfp4", what=why).PRESET_SCHEMES
    group = quantization.QuantizationScheme(targets=["Linear"], **presets[PRESETS[scheme]])
    config = quantization.QuantizationConfig(config_groups={"group_0": group}, format=COMPRESSION,
                                             quantization_status="compressed", ignore=list(IGNORE))
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
            "sparsity_config": {}, "transform_config": {},
            **config.model_dump(mode="json", exclude={"quant_method"})}


# --------------------------------------------------------------------------- output plan

@dataclass
class Entry:
    """Output tensors made together: one kept source tensor, or one quantized module's set."""

    source: str
    nbytes: int
    target: Target | None = None


def _entries(found: dict, targets: dict[str, Target], activations: bool) -> list[Entry]:
    entries = []
    for name, (_, shape, dtype) in found.items():
        target = targets.get(name)
        if target is None:
            if dtype not in _ITEMSIZE:
                raise errors.ConversionError(f"{name} has safetensors dtype {dtype}, which is not supported")
            nbytes = torch.Size(shape).numel() * _ITEMSIZE[dtype]
        else:
            n, k = target.shape
            nbytes = n * k // 2 + n * k // fmt.GROUP + 4 * (2 if activations else 1)
        entries.append(Entry(name, nbytes, target))
    return entries


def _shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _produce(entry: Entry, reader: _Reader) -> dict[str, torch.Tensor]:
    tensor = reader.tensor(entry.source)
    t = entry.target
    if t is None:
        return {entry.source: tensor}
    packed = fmt.quantize_weight(tensor, global_scale=t.weight_global_scale)
    out = {f"{t.module}.weight_packed": packed.packed, f"{t.module}.weight_scale": packed.scale,
           f"{t.module}.weight_global_scale": packed.global_scale}
    if t.input_global_scale is not None:
        out[f"{t.module}.input_global_scale"] = t.input_global_scale
    return out


def write_checkpoint(stage: Path, entries: list[Entry], reader: _Reader, max_bytes: int) -> int:
    """Write the shards (and the index when there are several); returns the number of shards."""
    shards = _shards(entries, max_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        tensors = {}
        for entry in shard:
            tensors.update(_produce(entry, reader))
        save_file(tensors, str(stage / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (stage / files.SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return len(shards)


# --------------------------------------------------------------------------- the conversion

def _check_source(src: Path) -> tuple[dict, str]:
    if not src.is_dir():
        raise errors.ModelNotFound(f"source directory not found: {src}", field="src")
    config, text, arch = load_config(src)
    if "quantization_config" in config:
        raise errors.ConversionError(f"{src} is already quantized; NVFP4 starts from the bf16 release", field="src")
    for fname in (files.HEAD_WEIGHTS, files.HEAD_CONFIG, files.TOKENIZER):
        if not (src / fname).is_file():
            raise errors.ModelNotFound(f"{fname} not found in {src}", field="src")
    head_hidden = read_json(src / files.HEAD_CONFIG).get("hidden_size")
    if head_hidden is not None and head_hidden != text.get("hidden_size"):
        raise errors.ConversionError(f"{files.HEAD_CONFIG} has hidden_size {head_hidden}, "
                                     f"the tower has {text.get('hidden_size')}")
    return config, arch


def quantize_release(src, out, *, scheme: str, name: str | None = None, calibration: list[dict] | None = None,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Quantize the HF release in ``src`` to the NVFP4 checkpoint directory ``out``; returns ``out``.

    ``scheme`` is "nvfp4a16" (W4A16) or "nvfp4" (W4A4, calibrated on ``calibration``: SystemOne
    requests, by default the built-in sample requests).
    """
    if scheme not in SCHEMES:
        raise errors.ConversionError(f"unknown NVFP4 scheme {scheme!r}; choose one of {', '.join(SCHEMES)}",
                                     field="scheme")
    activations = ACTIVATIONS[scheme]
    if calibration is not None and not activations:
        raise errors.ConversionError("calibration sets activation scales: it applies to nvfp4 (W4A4) only",
                                     field="calibration")
    if calibration is not None and not isinstance(calibration, (list, tuple)):
        raise errors.ConversionError("calibration must be a list of requests", field="calibration")
    src, out = Path(src), Path(out)
    config, arch = _check_source(src)
    config = {**config, "quantization_config": quantization_config(scheme)}
    found = scan_checkpoint(src)
    targets = find_targets(found, SUPPORTED[arch][1])
    entries = _entries(found, targets, activations)
    name = name or src.resolve().name
    with contextlib.ExitStack() as stack:
        reader = _Reader(stack, found)
        amax = {t.module: reader.tensor(source).float().abs().amax() for source, t in targets.items()}
        for t, shared in _shared(targets.values(), lambda t: fmt.global_scale(amax[t.module])):
            t.weight_global_scale = shared
        calibrated = None
        if activations:
            requests = default_requests() if calibration is None else list(calibration)
            inputs, tokens = calibrate(src, arch, [t.module for t in targets.values()], requests)
            for t, shared in _shared(targets.values(), lambda t: fmt.global_scale(inputs[t.module])):
                t.input_global_scale = shared
            calibrated = {"requests": len(requests), "tokens": tokens}
        with files.staged_directory(out) as stage:  # a failed conversion leaves no half directory
            shards = write_checkpoint(stage, entries, reader, max_shard_bytes)
            (stage / files.CHECKPOINT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            for fname in (files.HEAD_WEIGHTS, files.HEAD_CONFIG, files.TOKENIZER, TOKENIZER_CONFIG,
                          *PROCESSOR_FILES):
                if (src / fname).is_file():
                    shutil.copyfile(src / fname, stage / fname)
            source = {"path": str(src.resolve()), "scheme": scheme, "quantized_modules": len(targets),
                      "kept_tensors": len(found) - len(targets), "shards": shards, "calibration": calibrated,
                      "random_weights": (src / "RANDOM_WEIGHTS.json").is_file()}
            # The shards are hashed here, once: loading then trusts these hashes for the audit.
            shard_names = tuple(sorted(p.name for p in stage.glob("model*.safetensors")))
            files.write_manifest(stage, name, scheme,
                                 {"tower": files.CHECKPOINT_CONFIG, "head_weights": files.HEAD_WEIGHTS,
                                  "head_config": files.HEAD_CONFIG, "tokenizer": files.TOKENIZER},
                                 extra={"source": source}, also=shard_names)
    return out
