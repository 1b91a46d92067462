"""Clef's joint schema head: the PyTorch module, its strict loader, and helpers for tests and demos."""

from clef_gguf.heads.joint import LOG_100, QUESTION_TYPES, EvidenceRoutingLayer, JointSchemaHead
from clef_gguf.heads.load import (
    CONFIG_KEYS,
    SCALARS,
    check_config,
    head_scalars,
    load_head,
    random_head,
    read_head_config,
    save_head,
    synthetic_spans,
)

__all__ = [
    "CONFIG_KEYS",
    "LOG_100",
    "QUESTION_TYPES",
    "SCALARS",
    "EvidenceRoutingLayer",
    "JointSchemaHead",
    "check_config",
    "head_scalars",
    "load_head",
    "random_head",
    "read_head_config",
    "save_head",
    "synthetic_spans",
]
