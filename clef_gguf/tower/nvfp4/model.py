"""The Qwen3.5 text model in PyTorch with NVFP4 Linear layers, built from a checkpoint.

transformers' Qwen3.5 modules are the base (the same code the reference runs). The graph is
built on the meta device, so no dense copy of a single weight is ever made; each quantized
Linear becomes an ``NVFP4Linear`` holding the packed codes and scales, and every other tensor is
loaded as stored (cast to the compute dtype, except the embedding table, whose rows are cast when
looked up: for the 9B it is 2 GB in bf16 and would be 4 GB in fp32).
"""

from __future__ import annotations

import copy
import logging
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from clef_gguf.core import errors
from clef_gguf.core.deps import need
from clef_gguf.tower.nvfp4.checkpoint import ACTIVATION_SCALE, PACKED, Checkpoint
from clef_gguf.tower.nvfp4.kernels import NVFP4Linear

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicCache
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

EMBED = "embed_tokens.weight"
# transformers warns once per optional GDN kernel (causal-conv1d, flash-linear-attention) that its
# PyTorch fallback is slower; the tower says once itself which kernels run and whether it is slow.
logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)


def _transformers() -> tuple[ModuleType, ModuleType]:
    why = "the nvfp4 backend needs transformers (its Qwen3.5 modules)"
    configs = need("transformers.models.qwen3_5.configuration_qwen3_5", "nvfp4", what=why, field="backend")
    return configs, need("transformers.models.qwen3_5.modeling_qwen3_5", "nvfp4", what=why, field="backend")


def text_config(checkpoint: Checkpoint) -> Qwen3_5TextConfig:
    configs, _ = _transformers()
    raw = {k: v for k, v in checkpoint.text_config.items() if k != "quantization_config"}
    try:
        config = configs.Qwen3_5TextConfig(**raw)
    except (TypeError, ValueError, KeyError) as exc:
        raise errors.CorruptModel(f"{checkpoint.config_path}: not a Qwen3.5 text config ({exc})",
                                  field="tower") from None
    config._attn_implementation = "sdpa"
    return config


def _replace(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


class TextModel:
    """``hidden(ids, cache) -> [T, H]``: the final (post-norm) hidden states of ``ids`` appended to
    the sequence held by ``cache`` (a transformers cache; None: a fresh sequence, not kept)."""

    def __init__(self, checkpoint: Checkpoint, *, device: torch.device, dtype: torch.dtype) -> None:
        _, modeling = _transformers()
        self.modeling = modeling  # transformers' modeling_qwen3_5: which kernels it bound (linear_kernels)
        self.config = text_config(checkpoint)
        self.device, self.dtype = device, dtype
        with torch.device("meta"):
            model = modeling.Qwen3_5TextModel(self.config)
        prefix = checkpoint.prefix
        for full in checkpoint.quantized:
            name = full[len(prefix):]
            try:
                dense = model.get_submodule(name)
            except AttributeError:
                raise errors.CorruptModel(f"{full} is not a module of the Qwen3.5 text model",
                                          field="tower") from None
            if not isinstance(dense, torch.nn.Linear):
                raise errors.CorruptModel(f"{full} is quantized but is not a Linear layer", field="tower")
            _replace(model, name, NVFP4Linear(dense.in_features, dense.out_features,
                                              activations=checkpoint.scheme.activations,
                                              bias=dense.bias is not None))
        state = {}
        for key, meta in model.state_dict().items():
            source = prefix + key
            if not checkpoint.has(source):
                raise errors.CorruptModel(f"the checkpoint has no {source}", field="tower")
            tensor = checkpoint.tensor(source)
            if tuple(tensor.shape) != tuple(meta.shape):
                raise errors.CorruptModel(f"{source} has shape {list(tensor.shape)}, the config "
                                          f"says {list(meta.shape)}", field="tower")
            stored = key.rsplit(".", 1)[-1] in PACKED + (ACTIVATION_SCALE,)
            if not stored and key != EMBED and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            state[key] = tensor.to(device)
        model.load_state_dict(state, strict=True, assign=True)
        # Non-persistent buffers (the rotary frequencies) were made on the meta device.
        model.rotary_emb = modeling.Qwen3_5TextRotaryEmbedding(config=self.config).to(device)
        left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if left:
            raise errors.CorruptModel(f"tensors not loaded: {', '.join(left[:4])}", field="tower")
        self.model = model.eval()
        self.hidden_size = self.config.hidden_size
        self.vocab_size = self.config.vocab_size

    def quantized(self) -> list[NVFP4Linear]:
        return [m for m in self.model.modules() if isinstance(m, NVFP4Linear)]

    def dense_bytes(self) -> int:
        """Bytes of every quantized layer's dense copy in the compute dtype (the native FP4 ones need none)."""
        return sum(m.dense_bytes(self.dtype) for m in self.quantized())

    def materialize(self) -> None:
        """Dequantize every quantized layer once, keeping the dense weights (``NVFP4Linear.materialize``)."""
        for m in self.quantized():
            m.materialize(self.dtype)

    def new_cache(self) -> DynamicCache:
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.config)

    @staticmethod
    def copy_cache(cache: DynamicCache) -> DynamicCache:
        return copy.deepcopy(cache)

    @staticmethod
    def cache_bytes(cache: DynamicCache) -> int:
        """Bytes of every tensor a cache holds (KV cells, conv and recurrent states)."""
        seen: set[int] = set()
        total = 0

        def walk(value: object) -> None:
            nonlocal total
            if isinstance(value, torch.Tensor):
                if id(value) not in seen:
                    seen.add(id(value))
                    total += value.numel() * value.element_size()
            elif isinstance(value, (list, tuple)):
                for v in value:
                    walk(v)
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v)
            elif hasattr(value, "__dict__") and not isinstance(value, type):
                for v in vars(value).values():
                    walk(v)

        for layer in getattr(cache, "layers", []):
            walk(layer)
        return total

    @torch.inference_mode()
    def hidden(self, ids: torch.Tensor, cache: DynamicCache | None = None, past: int = 0,
               media: list[tuple[int, int, torch.Tensor]] | None = None,
               mrope: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of ``ids`` (tokens ``past``... of the prompt). ``media``: ``(start,
        stop, rows)`` runs of ``ids`` whose input is the vision tower's ``rows`` instead of their
        token embedding; ``mrope``: the (t, h, w) positions [3, len(ids)] media prompts take."""
        ids = ids.to(self.device, torch.long)
        embeds = F.embedding(ids, self.model.embed_tokens.weight).to(self.dtype)[None]
        for start, stop, rows in media or ():
            embeds[0, start:stop] = rows.to(self.device, self.dtype)
        # Positions given explicitly: a hybrid cache's first layer may be a recurrent one, which
        # has no sequence length to count from.
        positions = (torch.arange(past, past + len(ids), device=self.device)[None] if mrope is None
                     else mrope.to(self.device, torch.long)[:, None, :])
        out = self.model(inputs_embeds=embeds, position_ids=positions, past_key_values=cache,
                         use_cache=cache is not None)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def hidden_many(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Final hidden states of several fresh prompts in one forward (no cache): the rows are
        right-padded to the longest, each at positions 0.. . Attention is causal and so are the
        linear attention's convolution and recurrence, so no token sees the padding after it: each
        row's states are its prompt's alone (up to the float rounding of a batched matmul)."""
        longest = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), longest), dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt.to(self.device, torch.long)
        embeds = F.embedding(ids, self.model.embed_tokens.weight).to(self.dtype)
        positions = torch.arange(longest, device=self.device)[None].expand(len(prompts), -1)
        out = self.model(inputs_embeds=embeds, position_ids=positions, use_cache=False)
        return [out.last_hidden_state[row, :len(prompt)] for row, prompt in enumerate(prompts)]
