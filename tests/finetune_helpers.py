"""Fine-tunes of the tiny release as clef-finetune 0.1.0 writes them, and their reference.

``peft_checkpoint`` builds a LoRA with PEFT over exactly the modules clef-finetune's ``train`` wraps
(its own target discovery and regex), gives A and B seeded non-zero values (a trained adapter's B is
never zero; PEFT's default leaves it at zero), perturbs the release head, and saves the three files
with clef-finetune's own ``save_checkpoint``. ``merged_release`` is clef-finetune's own ``merge``.
``reference_probabilities`` is the parity tool's transformers reference. So the layouts and the
reference are the tool's, not copies of it that could drift.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

# How far the LoRA moves each target weight: std(scale * B @ A) = LORA_STRENGTH / sqrt(fan_in),
# against the tiny release's 1 / sqrt(fan_in) weights. Large enough that answers move visibly.
LORA_STRENGTH = 0.5
# Relative size of the seeded noise added to every head tensor (the retrained head).
HEAD_NOISE = 0.2
# Each file the merge writes beside the weights; what the converter and the reference read.
MERGED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "joint_head.safetensors",
                "joint_head_config.json", "joint_schema_model.py", "CLEF_FINETUNE.json")
# Merge keys clef-finetune 0.1.0 writes in CLEF_FINETUNE.json (clef_finetune/export.py).
PROVENANCE_KEYS = ("tool", "base_model", "checkpoint", "dtype", "head_dtype",
                   "joint_schema_model_sha256", "train_config")


def _seeded_lora(peft_model: torch.nn.Module, seed: int, rank: int, alpha: float) -> int:
    """Give every lora_A / lora_B a seeded value; returns how many modules it touched."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(peft_model.named_parameters())
    # B's std makes (alpha / rank) * B @ A have std LORA_STRENGTH / sqrt(fan_in).
    b_std = LORA_STRENGTH * math.sqrt(rank) / alpha
    touched = 0
    with torch.no_grad():
        for name in sorted(params):
            if ".lora_A." in name:
                a = params[name]
                a.copy_(torch.randn(a.shape, generator=gen) / math.sqrt(a.shape[1]))
                b = params[name.replace(".lora_A.", ".lora_B.")]
                b.copy_(torch.randn(b.shape, generator=gen) * b_std)
                touched += 1
    return touched


def _perturbed_head(release: Path, seed: int) -> torch.nn.Module:
    """The release head in fp32 with seeded noise on every tensor, scalars included."""
    from clef_gguf.heads import load_head

    head = load_head(release / "joint_head_config.json", release / "joint_head.safetensors",
                     dtype=torch.float32)
    gen = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for _name, tensor in sorted(head.state_dict().items()):
            size = float(tensor.abs().mean()) + 0.05
            tensor.add_(torch.randn(tensor.shape, generator=gen) * HEAD_NOISE * size)
    return head


def peft_checkpoint(release: Path, out: Path, seed: int, rank: int = 8, alpha: float = 16) -> Path:
    """A clef-finetune checkpoint of ``release`` in ``out``: ``adapter/`` (PEFT LoRA over every
    nn.Linear of the language model, seeded non-zero A and B), ``joint_head.safetensors`` (the
    release head plus seeded noise, fp32), ``training_state.pt`` and ``train_config.json``."""
    from clef_finetune.model import discover_lora_targets, load_backbone, targets_regex
    from clef_finetune.train import DEFAULTS, deep_update, save_checkpoint
    from peft import LoraConfig, get_peft_model

    release, out = Path(release), Path(out)
    cfg = deep_update(DEFAULTS, {
        "model": {"path": str(release), "dtype": "float32"},
        "lora": {"r": rank, "alpha": alpha, "dropout": 0.0},
        "train": {"seed": seed, "max_steps": 0},
        "output_dir": str(out.parent),
    })
    backbone = load_backbone(release, torch.float32, "cpu")
    for p in backbone.parameters():
        p.requires_grad_(False)
    targets = discover_lora_targets(backbone)
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets_regex(targets),
                      bias="none")
    peft_model = get_peft_model(backbone, lora)
    if _seeded_lora(peft_model, seed, rank, alpha) != len(targets):
        raise AssertionError("PEFT wrapped other modules than clef-finetune's targets")
    head = _perturbed_head(release, seed)
    lora_params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora_params, lr=cfg["train"]["lr"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    rng_state = {"python": random.Random(seed).getstate(), "torch": torch.get_rng_state()}
    save_checkpoint(out, peft_model, head, optimizer, scheduler, 0, rng_state, cfg)
    return out


def lora_targets(release: Path) -> list[str]:
    """The module names clef-finetune 0.1.0 wraps in ``release`` (its own discovery)."""
    from clef_finetune.model import discover_lora_targets, load_backbone

    return discover_lora_targets(load_backbone(Path(release), torch.float32, "cpu"))


def safetensors_names(directory: Path) -> set[str]:
    """Every tensor name in the ``*.safetensors`` weight files of a release (the head excluded)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(Path(directory).glob("model*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


def merged_release(release: Path, checkpoint: Path, out: Path, *, dtype: str = "float32") -> Path:
    """``checkpoint`` merged into ``release`` by clef-finetune 0.1.0's ``merge`` (PEFT
    ``merge_and_unload``, weights, head, tokenizer files, ``CLEF_FINETUNE.json``). ``dtype`` is the
    weights' and the head's: float32 (default) keeps the merged sums exact for the parity gates;
    clef-finetune's own default is bfloat16.

    The weights keep the release's tensor names; only the MTP block is gone (transformers does not
    load ``mtp.*``, so no merge can write it back)."""
    from clef_finetune.export import merge

    release, out = Path(release), Path(out)
    merge(release, checkpoint, out, dtype=dtype, head_dtype=dtype)
    original, merged = safetensors_names(release), safetensors_names(out)
    extra = merged - original
    dropped = original - merged
    if extra or any(not name.startswith("mtp.") for name in dropped):
        raise AssertionError(f"merged names differ from the release's: extra {sorted(extra)[:5]}, "
                             f"dropped {sorted(n for n in dropped if not n.startswith('mtp.'))[:5]}")
    missing = [name for name in MERGED_FILES if not (out / name).is_file()]
    if missing:
        raise AssertionError(f"the merge did not write {missing}")
    info = json.loads((out / "CLEF_FINETUNE.json").read_text())
    if set(info) != set(PROVENANCE_KEYS):
        raise AssertionError(f"CLEF_FINETUNE.json keys {sorted(info)} != {sorted(PROVENANCE_KEYS)}")
    return out


def reference_probabilities(release_dir: Path, requests: list[dict[str, Any]]) -> list[list[np.ndarray]]:
    """The transformers reference (fp32 backbone, lm_head rows, the release's head) per request."""
    from clef_gguf.tools.parity import Reference

    reference = Reference(release_dir)
    return [reference.probabilities(request) for request in requests]


def max_abs_dp(ours: list[list[np.ndarray]], ref: list[list[np.ndarray]]) -> float:
    """Max |dp| over every option of every question."""
    return max(float(np.abs(np.asarray(a, dtype=np.float64) - r).max())
               for a_q, r_q in zip(ours, ref) for a, r in zip(a_q, r_q))


def without_run_facts(response: dict[str, Any]) -> dict[str, Any]:
    """A response without what depends on the run rather than the answer: ``usage.cached_tokens``
    (what the state cache held) and ``timings`` where a caller added them."""
    usage = {k: v for k, v in response.get("usage", {}).items() if k != "cached_tokens"}
    return {k: v for k, v in response.items() if k != "timings"} | {"usage": usage}
