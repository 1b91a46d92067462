"""Random joint heads and made-up spans: the head of every synthetic release (``tiny``, ``big``), the
tests' heads, and the spans that time a head without a prompt (``pick``'s speed probe, benchmarks)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from clef_gguf.heads import SCALARS, JointSchemaHead, check_config

# ``clef-gguf bench``'s questions as option counts: a noul, a 4-way choice, a 5-level score.
BENCH_COUNTS = (2, 4, 5)


Spans = list[tuple[int, int]]


def synthetic_spans(start: int, counts: Sequence[int] = BENCH_COUNTS) -> tuple[Spans, Spans]:
    """(question spans, option spans) laid out from token ``start``: each question 10 tokens, then its
    options of 12 tokens each, a 4-token gap after every span; for timing a head without a prompt."""
    questions: Spans = []
    options: Spans = []
    pos = start
    for count in counts:
        questions.append((pos, pos + 10))
        pos += 14
        for _ in range(count):
            options.append((pos, pos + 12))
            pos += 16
    return questions, options


def random_head(
    config: Mapping, seed: int = 0, scalars: tuple[float, float, float] = (1.7, 2.3, -0.6)
) -> JointSchemaHead:
    """A reproducible random fp32 head for tests and demo models.

    Matrices have std 1/sqrt(fan_in) so activations stay O(1); LayerNorm weights are 1 + noise so a test catches
    swapped norms; ``scalars`` = (prior_logit_scale, joint_logit_scale, residual_gate), non-zero so the gate
    cannot hide half the arithmetic.
    """
    head = JointSchemaHead(**check_config(config, source="config"))
    generator = torch.Generator().manual_seed(seed)

    def noise(tensor: torch.Tensor, std: float) -> torch.Tensor:
        return torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(tensor.dtype) * std

    with torch.no_grad():
        for module in head.modules():
            for name, parameter in module.named_parameters(recurse=False):
                if parameter.ndim == 0:
                    continue
                if isinstance(module, nn.LayerNorm):
                    shift = 1.0 if name == "weight" else 0.0
                    parameter.copy_(noise(parameter, 0.25) + shift)
                elif parameter.ndim == 2:
                    std = 0.5 if isinstance(module, nn.Embedding) else 1.0 / math.sqrt(parameter.shape[1])
                    parameter.copy_(noise(parameter, std))
                else:
                    parameter.copy_(noise(parameter, 0.1))
        for name, value in zip(SCALARS, scalars, strict=True):
            getattr(head, name).fill_(float(value))
    return head.eval()
