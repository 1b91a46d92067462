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
from safetensors import safe_open

from clef_gguf.core import errors

FORMAT = "nvfp4-pack-quantized"
PACKED = ("weight_packed", "weight_scale", "weight_global_scale")
ACTIVATION_SCALE = "input_global_scale"
# Where the text model's tensors live in the two Hugging Face layouts of Qwen3.5.
TEXT_PREFIXES = ("model.language_model.", "model.")
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Scheme:
    name: str  # NVFP4 (W4A4) or NVFP4A16 (weights only)
    activations: bool  # the activations are FP4 too: every quantized Linear has an input scale


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise errors.CorruptModel(f"{path} is not readable JSON ({exc})", field="tower") from None
    if not isinstance(data, dict):
        raise errors.CorruptModel(f"{path} is not a JSON object", field="tower")
    return data


def parse_quantization(config: dict, path: Path) -> Any:  # compressed-tensors' QuantizationConfig (untyped)
    """The ``quantization_config``, validated by compressed-tensors itself (the format's owner)."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise errors.MissingDependency("the nvfp4 backend needs compressed-tensors: "
                                       "pip install 'clef-gguf[nvfp4]'", field="backend") from None
    raw = config.get("quantization_config")
    try:
        parsed = QuantizationConfig.model_validate(raw)
    except Exception as exc:  # pydantic's ValidationError, or a TypeError on a non-dict
        raise errors.CorruptModel(f"{path}: quantization_config is not a compressed-tensors "
                                  f"config ({str(exc).splitlines()[0]})", field="tower") from None
    if parsed.format != FORMAT:
        raise errors.CorruptModel(f"{path}: format {parsed.format!r} is not {FORMAT!r}: the nvfp4 "
                                  "backend runs NVFP4 checkpoints only", field="tower")
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
            raise errors.CorruptModel(f"{self.config_path}: not a Qwen3.5 text model", field="tower")
        self.text_config = text
        self._where = self._index()
        prefix = next((p for p in TEXT_PREFIXES if f"{p}norm.weight" in self._where), None)
        if prefix is None:
            raise errors.CorruptModel(f"{self.directory} holds no Qwen3.5 text model "
                                      "(no model.language_model.norm.weight)", field="tower")
        self.prefix: str = prefix
        self.quantized = sorted(n[:-len(".weight_packed")] for n in self._where
                                if n.startswith(self.prefix) and n.endswith(".weight_packed"))
        if not self.quantized:
            raise errors.CorruptModel(f"{self.directory} has no NVFP4 tensors (*.weight_packed)",
                                      field="tower")
        with_input = [m for m in self.quantized if f"{m}.{ACTIVATION_SCALE}" in self._where]
        if with_input and len(with_input) != len(self.quantized):
            raise errors.CorruptModel(f"{len(with_input)} of {len(self.quantized)} NVFP4 layers "
                                      f"have an {ACTIVATION_SCALE}: a mixed W4A4/W4A16 checkpoint",
                                      field="tower")
        self.scheme = Scheme("NVFP4" if with_input else "NVFP4A16", bool(with_input))
        for module in self.quantized:
            missing = [s for s in PACKED if f"{module}.{s}" not in self._where]
            if missing:
                raise errors.CorruptModel(f"{module} lacks {', '.join(missing)}", field="tower")
        tied = bool(self.config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        self.lm_head = "lm_head.weight" if "lm_head.weight" in self._where or not tied \
            else f"{self.prefix}embed_tokens.weight"
        if self.lm_head not in self._where:
            raise errors.CorruptModel(f"{self.directory} has no {self.lm_head}: the head needs its "
                                      "rows", field="tower")

    def _index(self) -> dict[str, Path]:
        """Tensor name -> the shard holding it (the index file, or every shard's own header)."""
        index = self.directory / INDEX
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise errors.CorruptModel(f"{index} has no weight_map of file names", field="tower")
            where = {name: self.directory / Path(shard).name for name, shard in weight_map.items()}
        else:
            where = {}
            for shard in sorted(self.directory.glob("*.safetensors")):
                if shard.name.startswith("joint_head"):
                    continue
                for name in self._keys(shard):
                    where[name] = shard
        if not where:
            raise errors.CorruptModel(f"{self.directory} has no model*.safetensors", field="tower")
        for shard in set(where.values()):
            if not shard.is_file():
                raise errors.ModelNotFound(f"checkpoint shard not found: {shard}", field="tower")
        return where

    @staticmethod
    def _keys(shard: Path) -> list[str]:
        try:
            with safe_open(shard, framework="pt") as f:
                return list(f.keys())
        except Exception as exc:  # safetensors raises its own SafetensorError on bad headers
            raise errors.CorruptModel(f"{shard} is not a readable safetensors file ({exc})",
                                      field="tower") from None

    @property
    def shards(self) -> list[Path]:
        return sorted(set(self._where.values()))

    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor(self, name: str) -> torch.Tensor:
        try:
            with safe_open(self._where[name], framework="pt") as f:
                return f.get_tensor(name)
        except KeyError:
            raise errors.CorruptModel(f"tensor {name} is missing from the checkpoint",
                                      field="tower") from None
        except Exception as exc:
            raise errors.CorruptModel(f"cannot read {name} from {self._where[name].name} ({exc})",
                                      field="tower") from None

    def rows(self, name: str, ids: list[int]) -> torch.Tensor:
        """Rows ``ids`` of a 2-D tensor, read one slice at a time (never the whole table)."""
        try:
            with safe_open(self._where[name], framework="pt") as f:
                table = f.get_slice(name)
                return torch.stack([table[i:i + 1][0] for i in ids]) if ids else \
                    torch.empty((0, table.get_shape()[1]))
        except Exception as exc:
            raise errors.CorruptModel(f"cannot read rows of {name} ({exc})", field="tower") from None

    def shape(self, name: str) -> list[int]:
        with safe_open(self._where[name], framework="pt") as f:
            return list(f.get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it (BF16, F32, U8, F8_E4M3...)."""
        with safe_open(self._where[name], framework="pt") as f:
            return f.get_slice(name).get_dtype()
