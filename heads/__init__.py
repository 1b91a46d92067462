"""Clef's joint schema head: the PyTorch module and its strict loader (random heads for tests and demos:
``clef_gguf.convert.synthetic.head``)."""

from clef_gguf.heads.joint import LOG_100, QUESTION_TYPES, EvidenceRoutingLayer, JointSchemaHead
from clef_gguf.heads.load import (
    CONFIG_KEYS,
    SCALARS,
    check_config,
    head_scalars,
    load_head,
    read_head_config,
    save_head,
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
    "read_head_config",
    "save_head",
]
