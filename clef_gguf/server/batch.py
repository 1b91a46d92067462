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

from dataclasses import dataclass
from typing import Any

import pydantic

from clef_gguf.runtime import engine
from clef_gguf.core import errors, refusals
from clef_gguf.core.errors import ClefError
from clef_gguf.media.sources import MediaPolicy
from clef_gguf.pipeline import answer
from clef_gguf.server import schema
from clef_gguf.server.state import ServedModel
from clef_gguf.server.workqueue import Job

ENTRY_KEYS = frozenset(schema.BatchEntry.model_fields)


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


def _refused(item_id: str, error: ClefError) -> BatchItem:
    return BatchItem(item_id, error=error.to_dict()["error"])


def _item_id(value: Any, index: int) -> str:
    return str(index) if value is None else value if isinstance(value, str) else str(value)


def _from_entry(i: int, entry: Any, body: schema.InputsBatch) -> BatchItem:
    if isinstance(entry, str):
        entry = {"id": str(i), "text": entry}
    if not isinstance(entry, dict):
        return _refused(str(i), errors.InvalidValue("a batch input is an object {id, text} or a "
                                                    "string", field=f"state.{i}"))
    item_id = _item_id(entry.get("id"), i)
    try:
        parsed = schema.BatchEntry.model_validate(entry)
    except pydantic.ValidationError as exc:
        problems = exc.errors()
        extra = sorted(str(p["loc"][0]) for p in problems if p["type"] == "extra_forbidden")
        if extra:
            return _refused(item_id, errors.UnknownField(
                f"unknown field '{extra[0]}' in a batch input", field=f"state.{i}.{extra[0]}"))
        return _refused(item_id, errors.MissingField("'text' is required",
                                                     field=f"state.{i}.text"))
    given = parsed.model_fields_set
    questions = parsed.questions if "questions" in given else body.questions
    if questions is None:
        return _refused(item_id, errors.MissingField("this input has no questions and none are "
                                                     "shared", field=f"state.{i}.questions"))
    shared = body.model_fields_set
    request: dict[str, Any] = {}
    if "model" in shared:
        request["model"] = body.model
    request["state"] = parsed.text
    request["questions"] = questions
    if "options" in shared:
        request["options"] = body.options
    if "calibration" in shared:
        request["calibration"] = body.calibration
    if "evidence" in shared:
        request["evidence"] = body.evidence
    if "images" in given:
        request["images"] = parsed.images  # the core refuses media with a clear reason
    return BatchItem(item_id, request)


def _from_request(i: int, request: Any, body: schema.RequestsBatch) -> BatchItem:
    if not isinstance(request, dict):
        return _refused(str(i), errors.InvalidValue("each entry of 'requests' must be a JSON "
                                                    "object", field=f"requests.{i}"))
    request = dict(request)
    item_id = _item_id(request.pop("id", None), i)
    if "model" not in request and "model" in body.model_fields_set:
        request["model"] = body.model
    return BatchItem(item_id, request)


def _whole_batch_error(exc: pydantic.ValidationError, where: str, count: int | None,
                       max_items: int) -> ClefError:
    """The first problem of a batch body, in the order a reader meets them: a key it does not
    have, then its list of inputs, then the number of inputs, then ``model``."""
    problems = exc.errors()
    extra = sorted(str(p["loc"][0]) for p in problems if p["type"] == "extra_forbidden")
    if extra:
        return errors.UnknownField(f"unknown field '{extra[0]}' in a batch", field=extra[0])
    if any(p["loc"][:1] == (where,) for p in problems):
        return errors.InvalidBatch(f"'{where}' must be a non-empty list", field=where)
    if count is not None and count > max_items:
        return _too_many(where, count, max_items)
    return errors.InvalidValue("'model' must be a string", field="model")


def _too_many(where: str, count: int, max_items: int) -> errors.TooManyInputs:
    return errors.TooManyInputs(refusals.request_size(f"at most {max_items} inputs per batch (got {count})"),
                                field=where)


def parse_batch(body: Any, max_items: int) -> tuple[list[BatchItem], str | None]:
    """The inputs in order, and the model name to echo. Whole-batch problems raise their ClefError;
    an input's own problem is that input's result."""
    if not isinstance(body, dict):
        raise errors.InvalidValue("the request must be a JSON object")
    if "requests" in body:
        model: type[schema.InputsBatch | schema.RequestsBatch] = schema.RequestsBatch
        where = "requests"
    elif isinstance(body.get("state"), list):
        model, where = schema.InputsBatch, "state"
    else:
        raise errors.InvalidBatch("a batch needs 'state' as a list of inputs ({id, text} objects or "
                                  "strings) or 'requests' as a list of requests", field="state")
    entries = body.get(where)
    count = len(entries) if isinstance(entries, list) else None
    try:
        parsed = model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise _whole_batch_error(exc, where, count, max_items) from None
    if count is not None and count > max_items:
        raise _too_many(where, count, max_items)
    if isinstance(parsed, schema.RequestsBatch):
        items = [_from_request(i, entry, parsed) for i, entry in enumerate(parsed.requests)]
    else:
        items = [_from_entry(i, entry, parsed) for i, entry in enumerate(parsed.state)]
    return items, parsed.model


def _fail(item: BatchItem, exc: Exception) -> None:
    """One input's failure stays inside its result, whatever it is: a bug or a tower fault hit
    by one input must not take the other inputs' answers with it."""
    item.error = engine.error_body(exc, f"batch input {item.id!r}")


def prepare_items(clef: engine.Model, items: list[BatchItem], media_policy: MediaPolicy | None = None) -> int:
    """Validate + tokenize every input not refused yet (runs in a tokenizer thread); the prompt
    tokens of the inputs prepared. ``media_policy``: where their images may come from."""
    tokens = 0
    for item in items:
        if item.error is None:
            prepared = engine.prepare(clef, item.request, media_policy=media_policy)
            if isinstance(prepared, Exception):
                _fail(item, prepared)
            else:
                item.prepared = prepared
                tokens += prepared.encoded.n_tokens
    return tokens


def compute_items(clef: engine.Model, items: list[BatchItem], job: Job) -> bool:
    """Run every prepared input (on the worker thread); False if the client left mid-batch.

    The engine runs them in groups of what the model's tower decodes together (several prompts
    per llama_decode where its packing policy says so, the same answers); the client leaving is
    checked between those groups, so answers nobody will read do not hold the model."""
    todo = [item for item in items if item.prepared is not None]
    outcomes = engine.run(clef, [item.prepared for item in todo], stop=lambda: job.abandoned)
    for item, outcome in zip(todo, outcomes):
        if isinstance(outcome, Exception):
            _fail(item, outcome)
        elif outcome is not None:
            item.response = outcome[0]
    return all(outcome is not None for outcome in outcomes)


def batch_response(items: list[BatchItem], model: str | None,
                   clef: ServedModel) -> dict[str, Any]:
    """Results in input order (``answer.batch_envelope``); a batch in which no input was answered
    says in its audit who would have answered."""
    not_computed = errors.NotComputed("not computed").to_dict()["error"]
    return answer.batch_envelope([(i.id, i.response, None if i.response else i.error or not_computed)
                                  for i in items], model, answer.audit(clef.provenance, clef.info))
