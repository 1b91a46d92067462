"""A compressed-tensors NVFP4 checkpoint directory: its configs and its tensors, read lazily.

What is quantized is decided from the tensor names (``<module>.weight_packed`` vs
``<module>.weight``), not from ``ignore``/``targets``: those name modules relative to
``Qwen3_5ForConditionalGeneration`` and stop matching under other wrappers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clef_gguf.core import errors
from clef_gguf.core.deps import need
from clef_gguf.formats.files import SAFETENSORS_INDEX
from clef_gguf.formats.safetensors import opened

# compressed-tensors' compression format (``quantization_config.format``) of the NVFP4 checkpoints read here
COMPRESSION = "nvfp4-pack-quantized"
PACKED = ("weight_packed", "weight_scale", "weight_global_scale")
ACTIVATION_SCALE = "input_global_scale"
# Where the text model's tensors live in the two Hugging Face layouts of Qwen3.5.
TEXT_PREFIXES = ("model.language_model.", "model.")
FIELD = "tower"
# ValueError: not UTF-8 or not JSON; RecursionError: nested past Python's stack.
JSON_ERRORS: dict[type[BaseException], type[errors.ClefError]] = {
    OSError: errors.CorruptModel, ValueError: errors.CorruptModel, RecursionError: errors.CorruptModel}
# compressed-tensors validates with pydantic (ValidationError, a ValueError), or fails on a non-dict
# with whatever pydantic raises then: any failure of its validation is a damaged config.
CONFIG_ERRORS: dict[type[BaseException], type[errors.ClefError]] = {Exception: errors.CorruptModel}


@dataclass(frozen=True)
class Scheme:
    name: str  # NVFP4 (W4A4) or NVFP4A16 (weights only)
    activations: bool  # the activations are FP4 too: every quantized Linear has an input scale


def _read_json(path: Path) -> dict:
    with errors.mapped(JSON_ERRORS, field=FIELD, what=f"{path} is not readable JSON"):
        data = json.loads(path.read_bytes())
    if not isinstance(data, dict):
        raise errors.CorruptModel(f"{path} is not a JSON object", field=FIELD)
    return data


def parse_quantization(config: dict, path: Path) -> Any:  # compressed-tensors' QuantizationConfig (untyped)
    """The ``quantization_config``, validated by compressed-tensors itself (the format's owner)."""
    QuantizationConfig = need("compressed_tensors.quantization", "nvfp4", field="backend",
                              what="the nvfp4 backend needs compressed-tensors").QuantizationConfig
    raw = config.get("quantization_config")
    with errors.mapped(CONFIG_ERRORS, field=FIELD,
                       what=f"{path}: quantization_config is not a compressed-tensors config"):
        parsed = QuantizationConfig.model_validate(raw)
    if parsed.format != COMPRESSION:
        raise errors.CorruptModel(f"{path}: format {parsed.format!r} is not {COMPRESSION!r}: the nvfp4 "
                                  "backend runs NVFP4 checkpoints only", field=FIELD)
    return parsed


class Checkpoint:
    """``config.json`` + ``model*.safetensors`` of one NVFP4 checkpoint directory."""

    def __init__(self, config_path: str | Path) -> None:
        self.config_path = Path(config_path)
        self.directory = self.config_path.parent
        self.config = _read_json(self.config_path)
        self.quantization = parse_quantization(self.config, self.config_path)
        text = self.config.get("text_config", self.config)
        if not isinstance(text, dict) or text.get("model_type", "qwen3_5_text") not in (
                "qwen3_5_text", "qwen3_5"):
            raise errors.CorruptModel(f"{self.config_path}: not a Qwen3.5 text model", field=FIELD)
        self.text_config = text
        self._where = self._index()
        prefix = next((p for p in TEXT_PREFIXES if f"{p}norm.weight" in self._where), None)
        if prefix is None:
            raise errors.CorruptModel(f"{self.directory} holds no Qwen3.5 text model "
                                      "(no model.language_model.norm.weight)", field=FIELD)
        self.prefix: str = prefix
        self.quantized = sorted(n[:-len(".weight_packed")] for n in self._where
                                if n.startswith(self.prefix) and n.endswith(".weight_packed"))
        if not self.quantized:
            raise errors.CorruptModel(f"{self.directory} has no NVFP4 tensors (*.weight_packed)",
                                      field=FIELD)
        with_input = [m for m in self.quantized if f"{m}.{ACTIVATION_SCALE}" in self._where]
        if with_input and len(with_input) != len(self.quantized):
            raise errors.CorruptModel(f"{len(with_input)} of {len(self.quantized)} NVFP4 layers "
                                      f"have an {ACTIVATION_SCALE}: a mixed W4A4/W4A16 checkpoint",
                                      field=FIELD)
        self.scheme = Scheme("NVFP4" if with_input else "NVFP4A16", bool(with_input))
        for module in self.quantized:
            missing = [s for s in PACKED if f"{module}.{s}" not in self._where]
            if missing:
                raise errors.CorruptModel(f"{module} lacks {', '.join(missing)}", field=FIELD)
        tied = bool(self.config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        self.lm_head = "lm_head.weight" if "lm_head.weight" in self._where or not tied \
            else f"{self.prefix}embed_tokens.weight"
        if self.lm_head not in self._where:
            raise errors.CorruptModel(f"{self.directory} has no {self.lm_head}: the head needs its "
                                      "rows", field=FIELD)

    def _index(self) -> dict[str, Path]:
        """Tensor name -> the shard holding it (the index file, or every shard's own header)."""
        index = self.directory / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise errors.CorruptModel(f"{index} has no weight_map of file names", field=FIELD)
            where = {name: self.directory / Path(shard).name for name, shard in weight_map.items()}
        else:
            where = {}
            for shard in sorted(self.directory.glob("*.safetensors")):
                if shard.name.startswith("joint_head"):
                    continue
                for name in self._keys(shard):
                    where[name] = shard
        if not where:
            raise errors.CorruptModel(f"{self.directory} has no model*.safetensors", field=FIELD)
        for shard in set(where.values()):
            if not shard.is_file():
                raise errors.ModelNotFound(f"checkpoint shard not found: {shard}", field=FIELD)
        return where

    @staticmethod
    def _keys(shard: Path) -> list[str]:
        with opened(shard, field=FIELD, kind="checkpoint shard") as f:
            return f.names()

    def _shard(self, name: str) -> Path:
        if name not in self._where:
            raise errors.CorruptModel(f"tensor {name} is missing from the checkpoint", field=FIELD)
        return self._where[name]

    @property
    def shards(self) -> list[Path]:
        return sorted(set(self._where.values()))

    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor(self, name: str) -> torch.Tensor:
        with opened(self._shard(name), field=FIELD, kind="checkpoint shard") as f:
            return f.tensor(name)

    def rows(self, name: str, ids: list[int]) -> torch.Tensor:
        """Rows ``ids`` of a 2-D tensor, read one slice at a time (never the whole table)."""
        with opened(self._shard(name), field=FIELD, kind="checkpoint shard") as f:
            return f.rows(name, ids)

    def shape(self, name: str) -> list[int]:
        with opened(self._shard(name), field=FIELD, kind="checkpoint shard") as f:
            return list(f.info(name).shape)

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it (BF16, F32, U8, F8_E4M3...)."""
        with opened(self._shard(name), field=FIELD, kind="checkpoint shard") as f:
            return f.info(name).dtype
