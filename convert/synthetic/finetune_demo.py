"""A random fine-tune of a release in clef-finetune's checkpoint layout, built without PEFT.

``build_finetune_checkpoint(release_dir, out)`` writes what ``clef-finetune train`` leaves in
``checkpoint-N/``: ``adapter/adapter_config.json`` + ``adapter/adapter_model.safetensors`` (PEFT's
format: a LoRA on every linear projection of the language model, one full-name regex as
clef-finetune writes it, fp32 A and non-zero B), ``joint_head.safetensors`` (the release's head in
fp32 plus seeded noise) and ``train_config.json``. RANDOM WEIGHTS: for exercising
``clef-gguf convert adapter`` and ``--adapter`` only.

Sizes: A has std 1/sqrt(in) and B std ``B_STD``/sqrt(rank), so with PEFT's scale alpha/rank = 2 each
adapted weight moves by ~2 * B_STD of its own size (the release's weights have std 1/sqrt(in)):
enough to change the answers visibly, small enough to keep every activation finite.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from clef_gguf.convert import tensor_map as tm
from clef_gguf.convert.hf_to_gguf import SUPPORTED, load_config, text_dims
from clef_gguf.convert.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, CHECKPOINT_ADAPTER_DIR, EDIT_SIDE,
                                    PEFT_PREFIX, TRAIN_CONFIG)
from clef_gguf.formats.files import HEAD_WEIGHTS

B_STD = 0.1
HEAD_NOISE = 0.05  # relative to each head tensor's mean magnitude
WARNING = "RANDOM WEIGHTS - a random fine-tune for testing the pipeline only"


def lora_modules(release_dir: Path) -> dict[str, tuple[int, int]]:
    """Every linear projection of the release's decoder layers: module name -> (out, in)."""
    _, text, arch = load_config(release_dir)
    dims = text_dims(text, tied=bool(text.get("tie_word_embeddings")))
    prefix = SUPPORTED[arch][1]
    out = {}
    for name, shape in sorted(tm.expected_shapes(dims).items(), key=lambda kv: tm.sort_key(kv[0])):
        if name.startswith("layers.") and len(shape) == 2 \
                and all(e in EDIT_SIDE for e in tm.gguf_name(name)[1]):
            out[prefix + name.removesuffix(".weight")] = (shape[0], shape[1])
    return out


def adapter_config(modules: list[str], release_dir: Path, rank: int) -> dict:
    """PEFT's LoraConfig as clef-finetune sets it (a full-match regex over the module names)."""
    return {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": str(release_dir),
            "revision": None, "inference_mode": True, "r": rank, "lora_alpha": 2 * rank,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
            "target_modules": r"^(?:" + "|".join(re.escape(m) for m in modules) + r")$",
            "exclude_modules": None, "lora_bias": False, "target_parameters": None}


def build_finetune_checkpoint(release_dir: Path, out: Path, *, seed: int = 1, rank: int = 8) -> Path:
    """Write a random LoRA + head fine-tune of ``release_dir`` into ``out``; returns ``out``."""
    release_dir, out = Path(release_dir), Path(out)
    modules = lora_modules(release_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (n_out, n_in) in modules.items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in ** 0.5
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = \
            torch.randn(n_out, rank, generator=gen) * (B_STD / rank ** 0.5)
    (out / CHECKPOINT_ADAPTER_DIR).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / CHECKPOINT_ADAPTER_DIR / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(list(modules), release_dir.resolve(), rank)
    (out / CHECKPOINT_ADAPTER_DIR / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    head = {}
    for name, tensor in load_file(str(release_dir / HEAD_WEIGHTS)).items():
        t = tensor.to(torch.float32)
        size = float(t.abs().mean()) if t.numel() else 0.0
        noise = torch.randn(t.shape, generator=gen) * HEAD_NOISE * (size or 1.0)
        head[name] = (t + noise).contiguous()
    save_file(head, str(out / HEAD_WEIGHTS), metadata={"format": "pt"})
    train = {"model": {"path": str(release_dir.resolve())},
             "lora": {"r": rank, "alpha": 2 * rank, "dropout": 0.0},
             "seed": seed, "generator": "clef_gguf.convert.synthetic.finetune_demo.build_finetune_checkpoint",
             "warning": WARNING}
    (out / TRAIN_CONFIG).write_text(json.dumps(train, indent=2) + "\n")
    return out
