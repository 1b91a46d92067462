"""After the tower: lexical rows -> head -> answer, each stage timed, for one prompt's hidden states.

Functions of the model's parts, not methods of it, so that ``Clef`` reads as the data path: prepare,
the tower, then these.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, cast

import numpy as np
import torch

from clef_gguf.heads.attention import HeadAttention, recording
from clef_gguf.heads.joint import JointSchemaHead
from clef_gguf.pipeline import answer
from clef_gguf.pipeline.encode import Encoded, Prepared
from clef_gguf.pipeline.lexical import RowStore


def head_logits(head: torch.nn.Module, lexical: RowStore, enc: Encoded,
                hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(flat fp32 logits of every option of every question, option token ids, perf_counter after the
    lexical rows) of a prompt's hidden states."""
    option_ids = enc.option_token_ids()
    rows = lexical.rows(option_ids)
    t = time.perf_counter()
    dtype = next(head.parameters()).dtype
    with torch.inference_mode():
        logits = head(torch.from_numpy(hidden), torch.from_numpy(rows).to(dtype), list(enc.question_spans),
                      list(enc.option_spans), list(enc.option_counts), list(enc.types))
    return logits.float().cpu().numpy(), option_ids, t


# Evidence (opt-in): the probabilities and the head's attention in, the response's "evidence" block out.
Explain = Callable[[list[np.ndarray], HeadAttention], dict[str, Any]]


def decision(prepared: Prepared, hidden: np.ndarray, cached: int, tower_ms: float, *, head: torch.nn.Module,
             lexical: RowStore, provenance: answer.Provenance, temperatures: Sequence[float],
             explain: Explain | None = None) -> answer.Decision:
    """The response to ``prepared`` from its hidden states, with the time of every stage (ms);
    ``explain``: the head's attention is recorded and the evidence added (timed as "evidence")."""
    enc, t1 = prepared.encoded, time.perf_counter()
    with ExitStack() as stack:
        attention = None if explain is None else stack.enter_context(recording(cast(JointSchemaHead, head)))
        logits, option_ids, t2 = head_logits(head, lexical, enc, hidden)
    t3 = time.perf_counter()
    probs = answer.split_probabilities(logits, enc.option_counts, tuple(temperatures))
    response = answer.envelope(prepared.request, probs, enc.n_tokens, provenance, truncated=enc.truncated,
                               option_token_ids=option_ids, cached_tokens=cached,
                               cached_media_tokens=0 if enc.media is None else enc.media.cached_tokens)
    t4 = time.perf_counter()
    if explain is not None and attention is not None:
        response["evidence"] = explain(probs, attention)
        response["audit"]["evidence"] = response["evidence"]["mode"]
    t5 = time.perf_counter()

    def ms(a: float, b: float) -> float:
        return round((b - a) * 1e3, 3)

    # "vision" (pictures only) is the part of "tower" spent in the vision tower or its cache.
    vision = {} if enc.media is None else {"vision": enc.media.vision_ms}
    return answer.Decision(response, {
        "encode": round(prepared.encode_ms, 3), **vision, "tower": round(tower_ms, 3),
        "lexical": ms(t1, t2), "head": ms(t2, t3), "answer": ms(t3, t4),
        **({} if explain is None else {"evidence": ms(t4, t5)}),
        "total": round(prepared.encode_ms + tower_ms + (t5 - t1) * 1e3, 3), "tokens": enc.n_tokens})
