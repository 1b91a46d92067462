"""transformers' own Qwen3.5 on an NVFP4 checkpoint's dequantized weights: what the nvfp4 backend
computes, by the reference's route.

The backend swaps each quantized Linear for an NVFP4 layer inside transformers' model; this module
instead copies every quantized weight's dequantized value into the stock ``nn.Linear`` (and, for W4A4,
fake-quantizes the activations ahead of it with the checkpoint's ``input_global_scale``). Same weights,
the reference's own layers: the tests hold the backend to it in fp32 on the CPU, the GPU check
(``scripts/gpu_check/nvfp4.py``) in bf16 on the GPU, like for like.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from clef_gguf.core.deps import need
from clef_gguf.tower.nvfp4 import format as fmt
from clef_gguf.tower.nvfp4.checkpoint import Checkpoint


def reference_model(release: str | Path, checkpoint: Checkpoint, *, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> torch.nn.Module:
    """``release``'s ``Qwen3_5ForConditionalGeneration`` with ``checkpoint``'s quantized weights
    dequantized in place (in fp32, then cast with the model to ``dtype``), in eval mode on ``device``."""
    transformers = need("transformers", "nvfp4", what="the nvfp4 reference model needs transformers")
    ref = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(release, dtype=torch.float32).eval()
    for name in checkpoint.quantized:
        module = ref.get_submodule(name)
        module.weight.data.copy_(fmt.dequantize_weight(checkpoint.tensor(f"{name}.weight_packed"),
                                                       checkpoint.tensor(f"{name}.weight_scale"),
                                                       checkpoint.tensor(f"{name}.weight_global_scale")))
        if checkpoint.scheme.activations:
            gi = checkpoint.tensor(f"{name}.input_global_scale").to(device)
            module.register_forward_pre_hook(
                lambda _m, args, gi=gi: (fmt.fake_quantize_activations(args[0], gi),))
    return ref.to(device=device, dtype=dtype)


def reference_hidden_states(model: Any, ids: np.ndarray) -> np.ndarray:  # transformers' model: untyped
    """The language model's last hidden states of one prompt, float32 on the host ``[tokens, hidden]``."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.model.language_model(input_ids=torch.as_tensor(ids, dtype=torch.long, device=device)[None],
                                         use_cache=False).last_hidden_state[0]
    return out.float().cpu().numpy()
