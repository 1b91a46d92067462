"""Logits -> SystemOne answers and envelope, as the reference ``systemone_answer`` (spec §5).

Probabilities are an fp32 softmax per question; reported numbers are Python ``round(x, 4)``
of the float64 value of each fp32 probability. Confidence is p_max (Cloudflare's formula).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from clef_gguf.core import errors
from clef_gguf.pipeline.request import Question, Request


class Decision(NamedTuple):
    """What answering one request gives: the SystemOne response and the time per stage (ms, and
    ``tokens``), as ``clef-gguf decide --timings`` prints them."""

    response: dict[str, Any]
    timings: dict[str, float]


def softmax32(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float32)
    e = np.exp(x - x.max())
    return (e / e.sum(dtype=np.float32)).astype(np.float32)


def _r(p: np.floating) -> float:
    return round(float(p), 4)


def answer(question: Question, probs: np.ndarray) -> dict:
    """One answer; ``probs`` follow the prompt's option order."""
    by_id = {opt.id: p for opt, p in zip(question.options, probs)}
    if question.type == "noul":
        return {"type": "noul", "noul": _r(by_id["true"])}
    if question.type == "choice":
        ordered = [(key, by_id[key]) for key in question.report_order]
        best = max(ordered, key=lambda kv: kv[1])  # first of tied maxima, in request order
        return {"type": "choice", "choice": best[0], "confidence": _r(best[1]),
                "probabilities": {key: _r(p) for key, p in ordered}}
    levels = np.asarray(probs, dtype=np.float32)
    expected = sum(i * float(p) for i, p in enumerate(levels))
    return {"type": "score", "score": round(expected, 4), "confidence": _r(levels.max()),
            "legend": {str(i): desc for i, desc in enumerate(question.legend)},
            "probabilities": {str(i): _r(p) for i, p in enumerate(levels)}}


@dataclass(frozen=True)
class Provenance:
    """What produced the answers: goes into the ``audit`` block TypeSafe-style clients require."""

    model_name: str
    model_hash: str
    backend: str
    precision: str  # the tower's weight format (q4_k_m, f32, nvfp4...): the audit's name for it
    template_sha256: str
    calibration_version: str = "none"
    # A fine-tune's own parts: {"name", "adapter_sha256", "head_sha256", ...}; None for the base
    # (whose audit stays as it was). For a merged release, what its CLEF_FINETUNE.json says.
    fine_tune: dict[str, Any] | None = None


def split_probabilities(logits: np.ndarray, counts: tuple[int, ...],
                        temperatures: tuple[float, ...] | None = None) -> list[np.ndarray]:
    """One fp32 softmax per question; ``temperatures`` (a calibration's, one per question)
    divide each question's logits first. None, and any T of exactly 1, leave them as they are."""
    logits = np.asarray(logits, dtype=np.float32)
    if not np.all(np.isfinite(logits)):
        raise errors.InferenceError("the head produced non-finite logits")
    bounds = np.cumsum((0,) + tuple(counts))
    temps = temperatures if temperatures is not None else (1.0,) * len(counts)
    return [softmax32(logits[a:b] if t == 1.0 else logits[a:b] / np.float32(t))
            for a, b, t in zip(bounds[:-1], bounds[1:], temps)]


def allowed_token_hash(option_token_ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(option_token_ids, dtype="<i4").tobytes()).hexdigest()


def envelope(request: Request, probs: list[np.ndarray], n_tokens: int, provenance: Provenance,
             *, truncated: bool, option_token_ids: np.ndarray, cached_tokens: int = 0) -> dict:
    answers = {q.id: answer(q, p) for q, p in zip(request.questions, probs)}
    response: dict[str, Any] = {
        "model": request.model if request.model is not None else provenance.model_name,
        "answers": answers,
        # cached_tokens: prompt tokens restored from the state cache instead of decoded
        "usage": {"input_tokens": n_tokens, "output_tokens": 0, "cached_tokens": cached_tokens},
        "audit": {
            "model_hash": provenance.model_hash,
            "calibration_version": provenance.calibration_version,
            "prompt_template_sha256": [provenance.template_sha256],
            "allowed_token_set_hash": [allowed_token_hash(option_token_ids)],
            "input_tokens": [n_tokens],
            "backend": provenance.backend,
            "precision": provenance.precision,
        },
    }
    if provenance.fine_tune is not None:
        response["audit"]["fine_tune"] = dict(provenance.fine_tune)
    if truncated:
        response["truncated"] = True
    if request.warnings:  # keys the reference ignores, named so that a typo does not go unseen
        response["warnings"] = [dict(w) for w in request.warnings]
    return response
