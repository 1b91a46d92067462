"""Shared by the eval and calibrate tests: a sharper copy of the tiny model and labelled lines.

The random tiny head's logits differ by a few tenths between options, so probabilities are
nearly uniform and a temperature can hardly be told from the labels of a few hundred questions.
A copy with both logit scales at 30 (the release's are exp(1.7) and exp(2.3)) spreads them over
several units, like a trained head; its tower is the same file.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np

SHARP_SCALE = 30.0
QUESTIONS = {}
for _i in range(2):
    QUESTIONS[f"angry{_i}"] = {"type": "noul", "instructions": f"Is the customer angry ({_i})?"}
    QUESTIONS[f"route{_i}"] = {"type": "choice", "instructions": f"Route it ({_i})",
                               "criteria": {"billing": "b", "support": "s", "engineering": "e", "sales": "x"}}
    QUESTIONS[f"severity{_i}"] = {"type": "score", "instructions": f"Severity ({_i})",
                                  "criteria": ["none", "minor", "moderate", "major", "critical"]}


def sharpened(model_dir: Path, out: Path, scale: float = SHARP_SCALE) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = load_file(str(out / "joint_head.safetensors"))
    weights["joint_logit_scale"] = torch.tensor(math.log(scale))
    weights["prior_logit_scale"] = torch.tensor(math.log(scale))
    save_file(weights, str(out / "joint_head.safetensors"), metadata={"format": "pt"})
    return out


def with_sampled_targets(lines: list[dict], temperature: float, seed: int) -> list[dict]:
    """``lines`` with every question labelled by a draw from softmax(logits / temperature)."""
    rng = np.random.default_rng(seed)
    out = []
    for line in lines:
        targets = {}
        for qid, q in line.get("questions", {}).items():
            z = np.asarray(q["logits"], dtype=np.float64) / temperature
            p = np.exp(z - z.max())
            targets[qid] = int(rng.choice(len(p), p=p / p.sum()))
        out.append(line | {"targets": targets})
    return out
