"""SystemOne request: the wire shape (pydantic) and the validated, typed form the encoder reads.

Reference semantics (spec §3.2, §8): instructions fall back to the question id when missing,
null or ""; noul criteria are merged over the defaults; choice options are sorted for the prompt
but reported in request order; score levels are "0".."n-1". On top of the reference, the limits
the ecosystem enforces (1-64 questions, 2-255 choice options, 2-10 score levels) and the
rejections where the reference would produce NaN or crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pydantic

from clef_gguf import errors

QUESTION_TYPES = ("noul", "choice", "score")
TYPE_INDEX = {name: i for i, name in enumerate(QUESTION_TYPES)}  # row of type_embedding
NOUL_DEFAULTS = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}
MAX_QUESTIONS = 64
CHOICE_OPTIONS = (2, 255)
SCORE_LEVELS = (2, 10)


class QuestionSpec(pydantic.BaseModel):
    """One question as sent. Unknown keys are refused: a typo must not silently change the prompt."""

    model_config = pydantic.ConfigDict(extra="forbid")

    type: Literal["noul", "choice", "score"]
    instructions: str | dict[str, Any] | list[Any] | None = None
    criteria: dict[str, Any] | list[Any] | None = None


class RequestOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    truncate_state: bool = False


class SystemOneRequest(pydantic.BaseModel):
    """``POST /v1/systemone`` body. ``state`` is any JSON value and is required (null allowed)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    model: str | None = None
    state: Any
    questions: dict[str, QuestionSpec]
    options: RequestOptions | None = None
    # Accepted so that we can refuse them with a clear reason instead of "unknown field".
    images: list[Any] | None = None
    videos: list[Any] | None = None
    media_kwargs: dict[str, Any] | None = None
    calibration: str | None = None


@dataclass(frozen=True)
class Option:
    id: str
    description: Any  # any JSON value; None = no description


@dataclass(frozen=True)
class Question:
    id: str
    type: str
    instruction: Any  # after the id fallback
    options: tuple[Option, ...]  # prompt order (choice: sorted by key)
    report_order: tuple[str, ...]  # option ids in the order answers report them
    legend: tuple[Any, ...] = ()  # score levels' raw descriptions

    @property
    def type_index(self) -> int:
        return TYPE_INDEX[self.type]


@dataclass(frozen=True)
class Request:
    model: str | None
    state: Any
    questions: tuple[Question, ...]
    truncate_state: bool = False


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
    if kind == "extra_forbidden":
        return errors.UnknownField(f"unknown field '{loc[-1]}'", field=where)
    if loc and loc[-1] == "type" and kind == "literal_error":
        return errors.InvalidQuestionType(
            f"type must be noul, choice, or score (got {first.get('input')!r})", field=where)
    # Union errors list every branch; name the field and what was accepted instead.
    msg = first["msg"]
    if kind.startswith(("dict_type", "string_type", "list_type", "model_type")) or "union" in kind:
        msg = f"has the wrong type ({type(first.get('input')).__name__})"
    return errors.InvalidValue(f"'{where}' {msg}", field=where)


def _check_count(qid: str, n: int, limits: tuple[int, int], kind: str, unit: str, where: str) -> None:
    lo, hi = limits
    if n < lo:
        raise errors.TooFewOptions(f"{qid}: a {kind} needs at least {lo} {unit} (got {n})", field=where)
    if n > hi:
        raise errors.TooManyOptions(f"{qid}: a {kind} accepts at most {hi} {unit} (got {n})",
                                    field=where)


def _choice_options(qid: str, criteria: Any, where: str) -> tuple[tuple[Option, ...], tuple[str, ...]]:
    if not isinstance(criteria, dict):
        raise errors.InvalidCriteria(
            "choice criteria must be an object {option_id: description}", field=where)
    _check_count(qid, len(criteria), CHOICE_OPTIONS, "choice", "options", where)
    if "" in criteria:
        raise errors.InvalidCriteria(f"{qid}: an option id is empty", field=where)
    # Prompt order is Python's str sort (code-point order), exactly as the reference.
    prompt = tuple(Option(key, criteria[key]) for key in sorted(criteria, key=str))
    return prompt, tuple(criteria)


def _score_options(qid: str, criteria: Any, where: str) -> tuple[tuple[Option, ...], tuple[Any, ...]]:
    if not isinstance(criteria, list):
        raise errors.InvalidCriteria(
            "score criteria must be a list of level descriptions, lowest first", field=where)
    _check_count(qid, len(criteria), SCORE_LEVELS, "score", "levels", where)
    return tuple(Option(str(i), desc) for i, desc in enumerate(criteria)), tuple(criteria)


def _noul_options(criteria: Any, where: str) -> tuple[Option, ...]:
    if criteria is None:
        criteria = {}
    if not isinstance(criteria, dict):
        raise errors.InvalidCriteria(
            'noul criteria must be an object {"true": ..., "false": ...} or omitted', field=where)
    unknown = [k for k in criteria if k not in NOUL_DEFAULTS]
    if unknown:
        # The reference ignores these; refusing tells the caller their text was not used.
        raise errors.InvalidCriteria(
            f"noul criteria accept only the keys 'true' and 'false' (got {unknown[0]!r})",
            field=f"{where}.{unknown[0]}")
    merged = {**NOUL_DEFAULTS, **criteria}  # explicit null overrides the default (reference)
    return (Option("true", merged["true"]), Option("false", merged["false"]))


def _question(qid: str, spec: QuestionSpec) -> Question:
    where = f"questions.{qid}"
    if qid == "":
        raise errors.EmptyQuestionId("question ids must not be empty", field="questions")
    instruction = spec.instructions
    if instruction is None or instruction == "":
        instruction = qid
    crit_where = f"{where}.criteria"
    if spec.type == "noul":
        options = _noul_options(spec.criteria, crit_where)
        return Question(qid, "noul", instruction, options, ("true", "false"))
    if spec.criteria is None:
        raise errors.MissingField(f"{qid}: criteria must not be empty", field=crit_where)
    if spec.type == "choice":
        options, order = _choice_options(qid, spec.criteria, crit_where)
        return Question(qid, "choice", instruction, options, order)
    options, legend = _score_options(qid, spec.criteria, crit_where)
    return Question(qid, "score", instruction, options, tuple(o.id for o in options), legend)


def parse_request(body: Any, *, truncate_state: bool = False) -> Request:
    """Validate a decoded JSON body; raise an ``InvalidRequest`` subclass naming the field."""
    if not isinstance(body, dict):
        raise errors.InvalidValue("the request must be a JSON object", field=None)
    try:
        wire = SystemOneRequest.model_validate(body)
    except pydantic.ValidationError as exc:
        raise _from_pydantic(exc, body) from None
    for media in ("images", "videos"):
        if getattr(wire, media):
            raise errors.Unsupported(
                f"{media} are not supported: GGUF language towers carry no vision tower",
                field=media)
    if wire.media_kwargs:
        raise errors.Unsupported("media_kwargs are not supported without media",
                                 field="media_kwargs")
    if wire.calibration not in (None, "none"):
        raise errors.Unsupported(f"no calibration {wire.calibration!r} is available; "
                                 "answers are the model's raw probabilities", field="calibration")
    if not wire.questions:
        raise errors.NoQuestions("at least one question is required", field="questions")
    if len(wire.questions) > MAX_QUESTIONS:
        raise errors.TooManyQuestions(f"at most {MAX_QUESTIONS} questions per request "
                                      f"(got {len(wire.questions)})", field="questions")
    questions = tuple(_question(qid, spec) for qid, spec in wire.questions.items())
    wants_truncation = truncate_state or bool(wire.options and wire.options.truncate_state)
    return Request(wire.model, wire.state, questions, wants_truncation)
