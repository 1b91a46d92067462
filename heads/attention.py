"""The joint schema head's own attention to the prompt, read while it decides (a response's evidence).

Two kinds of layer read the prompt: the evidence-routing layers (every option query attends to every
prompt token) and the deciding layers' cross-attention (every field attends to every prompt token).
:func:`recording` hooks those attention modules for one forward pass on the calling thread only and
recomputes each one's softmax weights from the very inputs it received, as ``nn.MultiheadAttention``
does with ``need_weights=True``; the forward pass itself is untouched, so the logits are the same bytes.

Memory: the kept weights are ``(routing_layers x options + layers x questions) x tokens`` float32,
and one head's ``max(options, questions) x tokens`` at a time while they are computed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from clef_gguf.heads.joint import EvidenceRoutingLayer, JointSchemaHead


def attention_weights(attention: nn.MultiheadAttention, query: Tensor, key: Tensor) -> Tensor:
    """float32 ``[L, S]``: ``attention``'s softmax weights of ``query`` [L, W] over ``key`` [S, W],
    averaged over its heads, with ``need_weights=True``'s arithmetic (no mask, packed in-projection)."""
    width, heads = attention.embed_dim, attention.num_heads
    dim = width // heads
    assert attention.in_proj_weight is not None, "the head's attention packs q, k and v in one projection"
    weight = attention.in_proj_weight.float()
    bias = attention.in_proj_bias.float() if attention.in_proj_bias is not None else None
    q = nn.functional.linear(query.float(), weight[:width], None if bias is None else bias[:width])
    k = nn.functional.linear(key.float(), weight[width:2 * width], None if bias is None else bias[width:2 * width])
    q = q * math.sqrt(1.0 / float(dim))
    total = query.new_zeros(query.shape[0], key.shape[0], dtype=torch.float32)
    # One head at a time bounds the peak to one [L, S] matrix besides the sum.
    for h in range(heads):
        cols = slice(h * dim, (h + 1) * dim)
        total += torch.softmax(q[:, cols] @ k[:, cols].T, dim=-1)
    return total / heads


@dataclass
class HeadAttention:
    """What one forward pass attended to, float32 on the CPU, layer by layer in the head's order.

    ``routing[r]`` [options, tokens]: routing layer r's weights from every option query (question
    order, then option order); ``deciding[l]`` [questions, tokens]: deciding layer l's cross-attention
    from every field. Each row sums to 1 over the prompt."""

    routing: list[Tensor] = field(default_factory=list)
    deciding: list[Tensor] = field(default_factory=list)

    def option_rows(self, owner: list[int]) -> Tensor:
        """[options, tokens]: for every option, the mean over every layer that reads the prompt on its
        behalf: the routing layers' rows of the option and the deciding layers' rows of its question."""
        rows = [layer for layer in self.routing] + [layer[owner] for layer in self.deciding]
        return torch.stack(rows).mean(0)


def _hook(record: HeadAttention, kind: str, thread: int) -> Any:
    def hook(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() != thread:  # another thread's forward pass while this one records
            return
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        weights = attention_weights(module, query[0].detach(), key[0].detach()).cpu()
        (record.routing if kind == "routing" else record.deciding).append(weights)
    return hook


@contextmanager
def recording(head: JointSchemaHead) -> Iterator[HeadAttention]:
    """Within the block, this thread's forward pass of ``head`` records its attention into the
    yielded ``HeadAttention`` (one pass per block)."""
    record, thread = HeadAttention(), threading.get_ident()
    modules = [(cast(EvidenceRoutingLayer, block).attention, "routing") for block in head.evidence_layers]
    modules += [(cast(nn.TransformerDecoderLayer, block).multihead_attn, "deciding") for block in head.layers]
    handles = [module.register_forward_pre_hook(_hook(record, kind, thread), with_kwargs=True)
               for module, kind in modules]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()
