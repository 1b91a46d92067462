"""Batch bodies: many inputs in one request, answered in order, each input failing on its own.

Two shapes are accepted:

* avrik-sdk's: ``{"state": [{"id", "text"[, "questions"]} | "text", ...], "questions": {...}}``
  - inputs share the top-level question set unless they carry their own; a bare string is an
  input whose id is its index. avrik-sdk posts this shape to ``/v1/systemone`` itself.
* a list of full requests: ``{"requests": [{state, questions, ...}, ...]}``; an optional ``id``
  in each names its result (default: the index).

The answer is ``{"model", "results": [{"id", "answers"} | {"id", "error"}], "usage", "audit"}``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from clef_gguf.errors import ClefError
from clef_gguf.server.http import ApiError, internal_error
from clef_gguf.server.workqueue import pack_size

log = logging.getLogger("clef_gguf.server")

AVRIK_KEYS = frozenset({"model", "state", "questions", "options", "calibration"})
REQUESTS_KEYS = frozenset({"model", "requests"})
ENTRY_KEYS = frozenset({"id", "text", "questions", "images"})
AUDIT_LISTS = ("prompt_template_sha256", "allowed_token_set_hash", "input_tokens")


@dataclass
class BatchItem:
    id: str
    request: dict | None = None
    error: dict | None = None  # {"code", "message", "field"} once refused
    prepared: Any = None
    response: dict | None = None


def is_batch(body: Any) -> bool:
    """Whether a ``/v1/systemone`` body is a batch.

    ``state`` may legitimately be any JSON array, so only avrik-sdk's exact entry shape counts:
    every entry an object with ``id`` and ``text`` and nothing but entry keys. Callers with such
    a state that is *not* a batch send ``?batch=false``.
    """
    if not isinstance(body, dict):
        return False
    if "requests" in body and "state" not in body:
        return True
    state = body.get("state")
    return (isinstance(state, list) and bool(state)
            and all(isinstance(e, dict) and "id" in e and "text" in e and e.keys() <= ENTRY_KEYS
                    for e in state))


def _refused(item_id: str, code: str, message: str, field: str | None) -> BatchItem:
    return BatchItem(item_id, error={"code": code, "message": message, "field": field})


def _item_id(value: Any, index: int) -> str:
    return str(index) if value is None else value if isinstance(value, str) else str(value)


def _from_entry(i: int, entry: Any, body: dict) -> BatchItem:
    if isinstance(entry, str):
        entry = {"id": str(i), "text": entry}
    if not isinstance(entry, dict):
        return _refused(str(i), "invalid_value", "a batch input is an object {id, text} or a "
                        "string", f"state.{i}")
    item_id = _item_id(entry.get("id"), i)
    extra = sorted(set(entry) - ENTRY_KEYS)
    if extra:
        return _refused(item_id, "unknown_field", f"unknown field '{extra[0]}' in a batch input",
                        f"state.{i}.{extra[0]}")
    if "text" not in entry:
        return _refused(item_id, "missing_field", "'text' is required", f"state.{i}.text")
    questions = entry.get("questions", body.get("questions"))
    if questions is None:
        return _refused(item_id, "missing_field", "this input has no questions and none are "
                        "shared", f"state.{i}.questions")
    request: dict[str, Any] = {}
    if "model" in body:
        request["model"] = body["model"]
    request["state"] = entry["text"]
    request["questions"] = questions
    for key in ("options", "calibration"):
        if key in body:
            request[key] = body[key]
    if "images" in entry:
        request["images"] = entry["images"]  # the core refuses media with a clear reason
    return BatchItem(item_id, request)


def _from_request(i: int, request: Any, body: dict) -> BatchItem:
    if not isinstance(request, dict):
        return _refused(str(i), "invalid_value", "each entry of 'requests' must be a JSON "
                        "object", f"requests.{i}")
    request = dict(request)
    item_id = _item_id(request.pop("id", None), i)
    if "model" not in request and "model" in body:
        request["model"] = body["model"]
    return BatchItem(item_id, request)


def parse_batch(body: Any, max_items: int) -> tuple[list[BatchItem], str | None]:
    """The inputs in order, and the model name to echo. Whole-batch problems raise ApiError."""
    if not isinstance(body, dict):
        raise ApiError(422, "invalid_value", "the request must be a JSON object")
    if "requests" in body:
        allowed, entries, where = REQUESTS_KEYS, body["requests"], "requests"
        convert = _from_request
    elif isinstance(body.get("state"), list):
        allowed, entries, where = AVRIK_KEYS, body["state"], "state"
        convert = _from_entry
    else:
        raise ApiError(422, "invalid_batch", "a batch needs 'state' as a list of inputs "
                       "({id, text} objects or strings) or 'requests' as a list of requests",
                       "state")
    extra = sorted(set(body) - allowed)
    if extra:
        raise ApiError(422, "unknown_field", f"unknown field '{extra[0]}' in a batch", extra[0])
    if not isinstance(entries, list) or not entries:
        raise ApiError(422, "invalid_batch", f"'{where}' must be a non-empty list", where)
    if len(entries) > max_items:
        raise ApiError(422, "too_many_inputs", f"at most {max_items} inputs per batch "
                       f"(got {len(entries)})", where)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(422, "invalid_value", "'model' must be a string", "model")
    return [convert(i, entry, body) for i, entry in enumerate(entries)], model


def _fail(item: BatchItem, exc: Exception, stage: str) -> None:
    """One input's failure stays inside its result, whatever it is: a bug or a tower fault hit
    by one input must not take the other inputs' answers with it."""
    if isinstance(exc, ClefError):
        item.error = exc.to_dict()["error"]
        return
    log.error("batch input %r failed in %s", item.id, stage, exc_info=exc)
    item.error = internal_error(exc).body()["error"]


def prepare_items(clef: Any, items: list[BatchItem]) -> None:
    """Validate + tokenize every input not refused yet (runs in a tokenizer thread)."""
    for item in items:
        if item.error is None:
            try:
                item.prepared = clef.prepare(item.request)
            except Exception as exc:  # noqa: BLE001 - reported in this input's result
                _fail(item, exc, "prepare")


def compute_items(clef: Any, items: list[BatchItem], job: Any) -> bool:
    """Run every prepared input (on the worker thread); False if the client left mid-batch.

    Where the model's tower packs prompts of this size (``pack_size``), that many inputs run at a
    time as one ``clef.run_many`` (several prompts per llama_decode, the same answers); the
    client leaving is checked between those groups."""
    todo = [item for item in items if item.prepared is not None]
    while todo:
        if job.abandoned:  # stop spending the model on answers nobody will read
            return False
        size = pack_size(clef, todo[0].prepared)
        group, todo = todo[:size], todo[size:]
        if len(group) == 1:
            _run_one(clef, group[0])
            continue
        try:
            outs = clef.run_many([item.prepared for item in group])
        except Exception as exc:  # noqa: BLE001 - a bug in the packed pass: each input says so
            outs = [exc] * len(group)
        for item, out in zip(group, outs):
            if isinstance(out, Exception):
                _fail(item, out, "run")
            else:
                item.response = out[0]
    return True


def _run_one(clef: Any, item: BatchItem) -> None:
    try:
        item.response = clef.run(item.prepared)[0]
    except Exception as exc:  # noqa: BLE001 - reported in this input's result
        _fail(item, exc, "run")


def _base_audit(clef: Any) -> dict:
    """The audit of a batch in which no input was answered: who would have answered."""
    p = getattr(clef, "provenance", None)
    info = getattr(clef, "info", {})
    return {"model_hash": getattr(p, "model_hash", None) or "unknown",
            "calibration_version": getattr(p, "calibration_version", "none"),
            "prompt_template_sha256": [], "allowed_token_set_hash": [], "input_tokens": [],
            "backend": getattr(p, "backend", None) or info.get("backend", "unknown"),
            "precision": getattr(p, "precision", None) or info.get("precision", "unknown")}


def batch_response(items: list[BatchItem], model: str | None, clef: Any) -> dict:
    """Results in input order; audit list fields hold one entry per answered input, in order."""
    results, audit, tokens = [], None, 0
    for item in items:
        if item.response is None:
            error = item.error or {"code": "not_computed", "message": "not computed",
                                   "field": None}
            results.append({"id": item.id, "error": error})
            continue
        result = {"id": item.id, "answers": item.response["answers"]}
        if item.response.get("truncated"):
            result["truncated"] = True
        results.append(result)
        tokens += item.response["usage"]["input_tokens"]
        one = item.response["audit"]
        if audit is None:
            audit = {k: (list(v) if k in AUDIT_LISTS else v) for k, v in one.items()}
        else:
            for key in AUDIT_LISTS:
                audit[key].extend(one.get(key, []))
    return {"model": model, "results": results,
            "usage": {"input_tokens": tokens, "output_tokens": 0},
            "audit": audit if audit is not None else _base_audit(clef)}
