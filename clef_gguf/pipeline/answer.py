"""Logits -> SystemOne answers and envelope, as the reference ``systemone_answer`` (spec §5).

Probabilities are an fp32 softmax per question; reported numbers are Python ``round(x, 4)``
of the float64 value of each fp32 probability. Confidence is p_max (Cloudflare's formula).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from clef_gguf.core import errors
from clef_gguf.core.questions import Part, winner
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


# What each part of an answer (core.questions.Part) is, from the question, its options in report order
# with their probabilities, and the index of the one that won there.
Ordered = list[tuple[str, np.float32]]
PARTS: dict[Part, Callable[[Question, Ordered, int], Any]] = {
    Part.FIRST: lambda q, ordered, won: _r(ordered[0][1]),
    Part.WINNER: lambda q, ordered, won: ordered[won][0],
    Part.EXPECTED_LEVEL: lambda q, ordered, won: round(sum(i * float(p) for i, (_, p) in enumerate(ordered)), 4),
    Part.CONFIDENCE: lambda q, ordered, won: _r(ordered[won][1]),
    Part.LEGEND: lambda q, ordered, won: {str(i): desc for i, desc in enumerate(q.legend)},
    Part.PROBABILITIES: lambda q, ordered, won: {key: _r(p) for key, p in ordered},
}


def answer(question: Question, probs: np.ndarray) -> dict:
    """One answer, shaped by the question type's registry entry; ``probs`` (fp32) follow the prompt's
    option order. ``InvalidQuestionType`` for a type nobody registered."""
    entry = question.question_type
    by_id = {opt.id: p for opt, p in zip(question.options, np.asarray(probs, dtype=np.float32))}
    ordered = [(key, by_id[key]) for key in question.report_order]
    won = winner([p for _, p in ordered])  # the first of tied maxima, in request order
    return {"type": entry.name, **{item.key: PARTS[item.part](question, ordered, won) for item in entry.answer}}


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


# The audit's fields that hold one entry per answered prompt (a batch's lists them all, in order).
AUDIT_LISTS = ("prompt_template_sha256", "allowed_token_set_hash", "input_tokens")


def audit(provenance: Provenance | None, info: Mapping[str, Any] | None = None, *,
          allowed_token_set_hash: list[str] | None = None, input_tokens: list[int] | None = None) -> dict:
    """The ``audit`` block TypeSafe-style clients require: who answered, and per answered prompt its
    template, allowed token set and token count (none: nothing was answered, as an empty batch says).
    ``info`` stands in for what a provenance-less server model cannot say."""
    hashes, tokens, info = allowed_token_set_hash or [], input_tokens or [], info or {}
    p = provenance
    block: dict[str, Any] = {
        "model_hash": p.model_hash if p and p.model_hash else "unknown",
        "calibration_version": p.calibration_version if p else "none",
        "prompt_template_sha256": [p.template_sha256] * len(hashes) if p else [],
        "allowed_token_set_hash": hashes, "input_tokens": tokens,
        "backend": p.backend if p and p.backend else info.get("backend", "unknown"),
        "precision": p.precision if p and p.precision else info.get("precision", "unknown")}
    if p is not None and p.fine_tune is not None and hashes:
        block["fine_tune"] = dict(p.fine_tune)
    return block


def envelope(request: Request, probs: list[np.ndarray], n_tokens: int, provenance: Provenance,
             *, truncated: bool, option_token_ids: np.ndarray, cached_tokens: int = 0,
             cached_media_tokens: int = 0) -> dict:
    """``cached_media_tokens``: the prompt's image and video tokens the vision tower did not run for;
    named in ``usage`` only when there are some (as ``truncated``), so that every answer computed
    afresh, and every text answer, has the reference's shape."""
    answers = {q.id: answer(q, p) for q, p in zip(request.questions, probs)}
    # cached_tokens: prompt tokens restored from the state cache instead of decoded
    usage = {"input_tokens": n_tokens, "output_tokens": 0, "cached_tokens": cached_tokens}
    if cached_media_tokens:
        usage["cached_media_tokens"] = cached_media_tokens
    response: dict[str, Any] = {
        "model": request.model if request.model is not None else provenance.model_name,
        "answers": answers,
        "usage": usage,
        "audit": audit(provenance, allowed_token_set_hash=[allowed_token_hash(option_token_ids)],
                       input_tokens=[n_tokens]),
    }
    if truncated:
        response["truncated"] = True
    if request.warnings:  # keys the reference ignores, named so that a typo does not go unseen
        response["warnings"] = [dict(w) for w in request.warnings]
    return response


def batch_envelope(results: list[tuple[Any, dict | None, dict | None]], model: str | None,
                   empty_audit: dict) -> dict[str, Any]:
    """A batch's response from its inputs' ``(id, response, error)`` in input order: each answered
    input's answers, one audit whose lists hold an entry per answered input (``empty_audit`` when
    none was), and, when fine-tunes named per input mixed in it, each result's model and hash."""
    answered = [r for _, r, _ in results if r is not None]
    mixed = len({r["audit"]["model_hash"] for r in answered}) > 1
    out: list[dict[str, Any]] = []
    for item_id, response, error in results:
        if response is None:
            out.append({"id": item_id, "error": error})
            continue
        result = {"id": item_id, "answers": response["answers"]}
        if response.get("truncated"):
            result["truncated"] = True
        if "evidence" in response:  # asked for (opt-in): each result carries its own
            result["evidence"] = response["evidence"]
        if mixed:
            result |= {"model": response["model"], "model_hash": response["audit"]["model_hash"]}
        out.append(result)
    block = empty_audit
    if answered:
        block = {k: (list(v) if k in AUDIT_LISTS else v) for k, v in answered[0]["audit"].items()}
        for r in answered[1:]:
            for key in AUDIT_LISTS:
                block[key].extend(r["audit"].get(key, []))
    return {"model": model, "results": out,
            "usage": {"input_tokens": sum(r["usage"]["input_tokens"] for r in answered), "output_tokens": 0},
            "audit": block}
