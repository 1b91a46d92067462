"""SystemOne request: the JSON reader, validation of the wire shape (``wire``) and the typed form the
encoder reads.

Reference semantics (spec §3.2, §8): instructions (any JSON value) fall back to the question id
when missing, null or ""; noul criteria are merged over the defaults and other keys are ignored;
choice options are sorted for the prompt but reported in request order; score levels are
"0".."n-1". Whatever the reference answers is answered: keys it ignores are ignored too, and named
in the response's ``warnings``. Refused beyond the reference: only what it cannot answer (it
crashes, or yields NaN). ``strict`` (``"options": {"strict": true}``, ``--strict``) adds the
ecosystem's limits (1-64 questions, 2-255 choice options, 2-10 score levels) and turns every
ignored key into an ``unknown_field`` error.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic

from clef_gguf.core import errors, refusals
from clef_gguf.core.questions import MAX_QUESTIONS, Criteria, QuestionType, question_type, unknown_type
from clef_gguf.pipeline.evidence import EvidenceSpec, parse_evidence
from clef_gguf.pipeline.wire import QuestionSpec, SystemOneRequest

# Deeper values cannot be rendered: Python's json (the reference's too) recurses per level and
# stops near 1000; refusing earlier keeps the error a clear one.
MAX_DEPTH = 512


# ---------------------------------------------------------------- the JSON reader
def _refuse_constant(name: str) -> Any:
    raise errors.InvalidJson(f"{name} is not valid JSON (RFC 8259 has no NaN or Infinity)",
                             field=None)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise errors.InvalidJson(f"the key {key!r} appears twice in one object; JSON readers "
                                         "keep one of them silently, so send it once", field=key)
            seen.add(key)
    return obj


def parse_json(raw: bytes | str) -> Any:
    """The one JSON reader of the CLI and the server: Python ``json`` (int/float kept apart and key
    order kept, both reach the prompt), refusing what it would otherwise accept silently:
    duplicate keys, NaN/Infinity, bytes that are not UTF-8, nesting past Python's limit."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise errors.InvalidJson(f"the body is not UTF-8 (byte {exc.start})",
                                 field=None) from None
    if not text.strip():
        raise errors.InvalidJson("the body is empty; send a JSON object", field=None)
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise errors.InvalidJson(f"not valid JSON: {exc}", field=None) from None
    except RecursionError:
        raise errors.InvalidJson("the JSON is nested too deeply to read", field=None) from None
    except ValueError as exc:  # a whole number past Python's int/str conversion limit (CVE-2020-10735)
        _refuse_long_number(text)
        raise errors.InvalidJson(f"not readable JSON: {exc}", field=None) from None


class _LongNumber(str):
    """A number's digits, kept as text to find where it was once the reader refused it."""


def _number_limit() -> int:
    """Python's digit limit for int <-> str conversions (0: none), which json.dumps and the
    reference's prompt rendering hit too."""
    return sys.get_int_max_str_digits()


def _refuse_long_number(text: str) -> None:
    """Read ``text`` again keeping over-long numbers as text, and refuse the first one by field."""
    limit = _number_limit()
    marked = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys,
                        parse_int=lambda digits: _LongNumber(digits) if limit and len(digits.lstrip("-")) > limit
                        else int(digits))
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(marked, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, _LongNumber):
            raise errors.InvalidValue(_long_number_message(len(node.lstrip("-"))), field=_field(path) or None)
        if isinstance(node, dict):
            stack.extend((item, path + (key,)) for key, item in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((item, path + (i,)) for i, item in reversed(list(enumerate(node))))


def _long_number_message(digits: int | None) -> str:
    size = f"has {digits} digits, more than" if digits else "is longer than"
    return (f"a whole number that {size} the {_number_limit()}-digit limit Python puts on "
            "converting numbers to text; send it as a string")


@dataclass(frozen=True)
class Option:
    id: str
    description: Any  # any JSON value; None = no description


@dataclass(frozen=True)
class Question:
    id: str
    type: str  # a registered type's name (core.questions)
    instruction: Any  # after the id fallback
    options: tuple[Option, ...]  # prompt order (choice: sorted by key)
    report_order: tuple[str, ...]  # option ids in the order answers report them
    legend: tuple[Any, ...] = ()  # score levels' raw descriptions

    @property
    def question_type(self) -> QuestionType:
        """The registry's entry for ``type``; ``InvalidQuestionType`` for a type nobody registered."""
        return question_type(self.type, field=f"questions.{self.id}.type")

    @property
    def type_index(self) -> int:
        return self.question_type.row


@dataclass(frozen=True)
class Request:
    model: str | None
    state: Any
    questions: tuple[Question, ...]
    truncate_state: bool = False
    warnings: tuple[dict, ...] = ()  # what was ignored, for the response's ``warnings``
    calibration: Any = None  # the version asked for, as sent (None: not sent); checked by the runtime
    images: tuple[str, ...] = ()  # each a data: URI, base64, a path or a URL (clef_gguf.media reads them)
    videos: tuple[Any, ...] = ()  # each a list of frames (image strings), nested as the reference takes them
    media_kwargs: dict[str, Any] | None = None  # the processor's keywords, as sent
    evidence: EvidenceSpec | None = None  # what the opt-in "evidence" key asked for (None: nothing)

    @property
    def has_media(self) -> bool:
        return bool(self.images or self.videos)


def _field(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def _data_path(body: Any, loc: tuple) -> tuple:
    """The part of pydantic's ``loc`` that exists in the body (drops union-branch tags)."""
    path, node = [], body
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            if isinstance(node, dict):
                path.append(part)  # a missing key: name it
            break
        path.append(part)
    return tuple(path)


def _from_pydantic(exc: pydantic.ValidationError, body: Any) -> errors.InvalidRequest:
    first = exc.errors()[0]
    loc = _data_path(body, first["loc"])
    where = _field(loc)
    kind = first["type"]
    if kind == "missing":
        return errors.MissingField(f"'{where}' is required", field=where)
    if loc and loc[-1] == "type" and kind == "literal_error":
        return unknown_type(first.get("input"), where)
    # Union errors list every branch; name the field and what was accepted instead.
    msg = first["msg"]
    if kind.startswith(("dict_type", "string_type", "list_type", "model_type")) or "union" in kind:
        msg = f"has the wrong type ({type(first.get('input')).__name__})"
    return errors.InvalidValue(f"'{where}' {msg}", field=where)


def check_json_values(value: Any, root: str | None = None) -> None:
    """Every string (keys too) must be encodable as UTF-8 (a lone surrogate from a ``\\ud800``
    escape is not) and nesting must stay under ``MAX_DEPTH``: else the tokenizer or the renderer
    would fail deep inside with an error that names nothing."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 0)]
    while stack:
        node, path, depth = stack.pop()
        where = _field(((root,) if root else ()) + path) or None
        if depth > MAX_DEPTH:
            raise errors.InvalidValue(f"nested deeper than {MAX_DEPTH} levels", field=where)
        if isinstance(node, str):
            _check_text(node, where)
        elif isinstance(node, int) and not isinstance(node, bool):
            _check_number(node, where)
        elif isinstance(node, dict):
            for key, item in node.items():
                _check_text(key, where)
                stack.append((item, path + (key,), depth + 1))
        elif isinstance(node, list):
            stack.extend((item, path + (i,), depth + 1) for i, item in enumerate(node))


def _check_number(number: int, where: str | None) -> None:
    """A Python int (API callers) the prompt renderer could not write as text."""
    limit = _number_limit()
    if limit and number.bit_length() > limit * 3.32 and abs(number) >= 10 ** limit:
        raise errors.InvalidValue(_long_number_message(None), field=where)


def _check_text(text: str, where: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise errors.InvalidValue(f"holds a lone surrogate (U+{ord(text[exc.start]):04X} at "
                                  f"character {exc.start}), which is not text", field=where) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Policy:
    """Lenient (the reference's behaviour, ignored keys become warnings) or strict (refusals)."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.warnings: list[dict] = []

    def ignored(self, where: str, why: str) -> None:
        if self.strict:
            raise errors.UnknownField(f"unknown field '{where.rsplit('.', 1)[-1]}' ({why})",
                                      field=where)
        self.warnings.append({"code": "ignored_field", "field": where,
                              "message": f"'{where}' was ignored: {why}"})

    def extras(self, model: pydantic.BaseModel, prefix: str, why: str) -> None:
        for key in model.model_extra or {}:
            self.ignored(f"{prefix}{key}", why)

    def count(self, qid: str, n: int, entry: QuestionType, where: str) -> None:
        if not self.strict or entry.counts is None:
            return
        lo, hi = entry.counts
        if n < lo:
            raise errors.TooFewOptions(refusals.too_few_options(qid, entry.name, n), field=where)
        if n > hi:
            raise errors.TooManyOptions(refusals.too_many_options(qid, entry.name, n), field=where)


# How each criteria rule (core.questions.Criteria) reads a question's criteria: (the options in prompt
# order, the option ids in the order answers report them, the legend).
Read = tuple[tuple[Option, ...], tuple[str, ...], tuple[Any, ...]]


def _fixed_options(qid: str, entry: QuestionType, criteria: Any, where: str, policy: _Policy) -> Read:
    """The type's own options; criteria (an optional object) override their default descriptions."""
    defaults = dict(entry.fixed)
    if criteria is None:
        criteria = {}
    if not isinstance(criteria, dict):
        shape = ", ".join(f'"{oid}": ...' for oid in defaults)
        raise errors.InvalidCriteria(f"{entry.name} criteria must be an object {{{shape}}} or omitted",
                                     field=where)
    for key in criteria:
        if key not in defaults:
            keys = " and ".join(f"'{oid}'" for oid in defaults)
            policy.ignored(f"{where}.{key}", f"{entry.name} criteria use only the keys {keys}")
    merged = {**defaults, **criteria}  # explicit null overrides the default (reference)
    return tuple(Option(oid, merged[oid]) for oid in defaults), tuple(defaults), ()


def _required(qid: str, criteria: Any, where: str) -> None:
    if criteria is None:
        raise errors.MissingField(f"{qid}: criteria must not be empty", field=where)
    if not criteria:
        raise errors.InvalidCriteria(f"{qid}: criteria must not be empty", field=where)


def _named_options(qid: str, entry: QuestionType, criteria: Any, where: str, policy: _Policy) -> Read:
    _required(qid, criteria, where)
    if not isinstance(criteria, dict):  # the reference crashes on a list here
        raise errors.InvalidCriteria(
            f"{entry.name} criteria must be an object {{option_id: description}}", field=where)
    policy.count(qid, len(criteria), entry, where)
    if policy.strict and "" in criteria:
        raise errors.InvalidCriteria(f"{qid}: an option id is empty", field=where)
    # Prompt order is Python's str sort (code-point order), exactly as the reference.
    prompt = tuple(Option(key, criteria[key]) for key in sorted(criteria, key=str))
    return prompt, tuple(criteria), ()


def _level_options(qid: str, entry: QuestionType, criteria: Any, where: str, policy: _Policy) -> Read:
    _required(qid, criteria, where)
    if not isinstance(criteria, list):  # the reference's legend lookup crashes on an object
        raise errors.InvalidCriteria(
            f"{entry.name} criteria must be a list of level descriptions, lowest first", field=where)
    policy.count(qid, len(criteria), entry, where)
    options = tuple(Option(str(i), desc) for i, desc in enumerate(criteria))
    return options, tuple(o.id for o in options), tuple(criteria)


READERS: dict[Criteria, Callable[[str, QuestionType, Any, str, _Policy], Read]] = {
    Criteria.FIXED: _fixed_options, Criteria.NAMED: _named_options, Criteria.LEVELS: _level_options}


def _question(qid: str, spec: QuestionSpec, policy: _Policy) -> Question:
    where = f"questions.{qid}"
    if policy.strict and qid == "":
        raise errors.EmptyQuestionId("question ids must not be empty", field="questions")
    policy.extras(spec, f"{where}.", "a question reads only type, instructions and criteria")
    instruction = spec.instructions
    if instruction is None or instruction == "":
        instruction = qid
    entry = question_type(spec.type, field=f"{where}.type")
    options, report_order, legend = READERS[entry.criteria](qid, entry, spec.criteria, f"{where}.criteria", policy)
    return Question(qid, entry.name, instruction, options, report_order, legend)


def parse_request(body: Any, *, truncate_state: bool = False, strict: bool = False,
                  calibrated: bool = False) -> Request:
    """Validate a decoded JSON body; raise an ``InvalidRequest`` subclass naming the field.

    ``calibrated``: the model applies a calibration, so the request's ``calibration`` is kept on
    the Request for the runtime to match against it; without one the key is ignored (reference)."""
    if not isinstance(body, dict):
        raise errors.InvalidValue("the request must be a JSON object", field=None)
    check_json_values(body)
    try:
        wire = SystemOneRequest.model_validate(body)
    except pydantic.ValidationError as exc:
        raise _from_pydantic(exc, body) from None
    policy = _Policy(strict or bool(wire.options and wire.options.strict))
    policy.extras(wire, "", "not a SystemOne request key")
    if wire.options is not None:
        policy.extras(wire.options, "options.", "options are truncate_state and strict")
    images = tuple(_image(item, f"images.{i}") for i, item in enumerate(wire.images or ()))
    videos = tuple(_frames(item, f"videos.{i}") for i, item in enumerate(wire.videos or ()))
    if wire.media_kwargs and not (images or videos):
        policy.ignored("media_kwargs", "there is no media to process")
    if not calibrated and wire.calibration not in (None, "none"):
        if policy.strict:
            raise errors.Unsupported(f"no calibration {_short(wire.calibration)} is available; "
                                     "answers are the model's raw probabilities",
                                     field="calibration")
        policy.ignored("calibration", f"no calibration {_short(wire.calibration)} is available; the "
                       "answers are the model's raw probabilities")
    if not wire.questions:
        raise errors.NoQuestions("at least one question is required", field="questions")
    if policy.strict and len(wire.questions) > MAX_QUESTIONS:
        raise errors.TooManyQuestions(refusals.too_many_questions(len(wire.questions)), field="questions")
    questions = tuple(_question(qid, spec, policy) for qid, spec in wire.questions.items())
    wants_truncation = truncate_state or bool(wire.options and wire.options.truncate_state)
    return Request(wire.model, wire.state, questions, wants_truncation, tuple(policy.warnings),
                   wire.calibration, images, videos, wire.media_kwargs if (images or videos) else None,
                   parse_evidence(wire.evidence))


# The image objects clients send, (bytes key, type key): avrik-sdk's and Workers AI's. Each is the
# same bytes as a data: URI.
IMAGE_OBJECTS = (("data", "media_type"), ("base64", "content_type"))


def _image(item: Any, where: str) -> str:
    """An image as the reference takes it (a string: data: URI, base64, path or URL); avrik-sdk's
    ``{"data": base64, "media_type"}`` and Workers AI's ``{"base64", "content_type"}`` objects are
    the same bytes as a data: URI."""
    if isinstance(item, str):
        return item
    for data, kind_key in IMAGE_OBJECTS:
        if isinstance(item, dict) and isinstance(item.get(data), str) and set(item) <= {data, kind_key}:
            kind = item.get(kind_key, "image/png")
            if not isinstance(kind, str):
                raise errors.InvalidValue(f"{kind_key} must be a string such as image/png",
                                          field=f"{where}.{kind_key}")
            return f"data:{kind};base64,{item[data]}"
    raise errors.InvalidValue("an image is a string (a data: URI, base64, a file path or a URL), "
                              '{"data": base64, "media_type": ...} or {"base64": ..., '
                              '"content_type": ...}', field=where)


def _frames(item: Any, where: str) -> Any:
    """A video as sent: lists (of lists) of frame strings; clef_gguf.media reads its nesting."""
    if isinstance(item, str):
        return item
    if not isinstance(item, list) or not item:
        raise errors.InvalidValue("a video is a non-empty list of frames (image strings)", field=where)
    return [_frames(x, f"{where}.{i}") if isinstance(x, list) else _image(x, f"{where}.{i}")
            for i, x in enumerate(item)]
