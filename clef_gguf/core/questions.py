"""The question types of the SystemOne contract: one registry, ``TYPES``, one entry per type holding all
that differs between types. Adding or changing a type is an edit here; every other module reads it:

- the head's ``type_embedding`` row: the entry's position in ``TYPES`` (``row``; never reorder them);
- the wire (``pipeline/wire.py`` generates each type's request model, ``NoulQuestion``...; the ``type``
  enum is ``QUESTION_TYPES``) and the response document (``server/schema.py`` generates each type's
  answer model from ``answer``);
- parsing (``pipeline/request.py`` reads criteria by the entry's ``criteria`` rule, ``counts`` under
  ``strict``) and the prompt (``name`` is its ``TYPE:`` line);
- answer shaping (``pipeline/answer.py`` computes each key of ``answer`` from its ``Part``), its text
  (``text``: ``--format text``; ``mcp_line``, ``summary``: the MCP tool);
- eval labels (``read_label``, ``label_of``), calibration keys and bands (``name``; ``fixed``: one band),
  the strict refusals' words (``too_few``, ``too_many``: ``core/refusals.py``).

A type nobody registered is an ``InvalidQuestionType`` wherever it is looked up (``question_type``).
Which option won is one rule, ``winner``, for answers, evidence and evaluation alike. The counts are
the ones ``strict`` enforces (the limits Jev and its clients enforce, not the reference's).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from clef_gguf.core import errors

MAX_QUESTIONS = 64


class Criteria(enum.Enum):
    """What a type's criteria are, and how its options come from them (``pipeline/request.py`` reads each)."""

    FIXED = "fixed"  # the type's own ``fixed`` options; criteria, an optional object, override their descriptions
    NAMED = "named"  # criteria: an object option id -> description; sorted for the prompt, reported in request order
    LEVELS = "levels"  # criteria: a list of descriptions, lowest first; options "0".."n-1", the list kept as legend


class Part(enum.Enum):
    """What one key of an answer holds (``pipeline/answer.py`` computes it, ``server/schema.py`` documents it)."""

    FIRST = "first"  # the first reported option's probability
    WINNER = "winner"  # the winning option's id (``winner``)
    EXPECTED_LEVEL = "expected_level"  # sum of level x probability
    CONFIDENCE = "confidence"  # the winning option's probability
    LEGEND = "legend"  # level -> its description as sent
    PROBABILITIES = "probabilities"  # option id -> probability, in report order


class Label(enum.Enum):
    """What an eval label (clef-finetune's ``data.normalize_label``) is for a type."""

    BOOLEAN = "boolean"  # true/false, or the option's id in any case: true the first (fixed) option, false the second
    OPTION = "option"  # an option id
    LEVEL = "level"  # a level index, or its digit string


@dataclass(frozen=True)
class AnswerKey:
    """One key of a type's answer: what it holds, and what ``/openapi.json`` says of it."""

    key: str
    part: Part
    description: str | None = None


@dataclass(frozen=True)
class QuestionType:
    name: str  # the wire's "type", the prompt's TYPE line, the calibration key
    criteria: Criteria
    answer: tuple[AnswerKey, ...]  # after "type", in this order
    label: Label
    criteria_doc: str  # /openapi.json's description of the type's question
    summary: str  # the MCP tool's description of the type
    text: str  # --format text: str.format over the answer
    mcp_line: str  # the MCP summary line: str.format over the answer (``likeliest``: the top level's description)
    fixed: tuple[tuple[str, str], ...] = ()  # Criteria.FIXED: (option id, default description), prompt order
    counts: tuple[int, int] | None = None  # strict: the fewest and most options
    too_few: str | None = None  # strict's refusal words (core/refusals.py formats lo, hi, lo_word, n)
    too_many: str | None = None

    @property
    def row(self) -> int:
        """The head's ``type_embedding`` row (and the index the encoder records)."""
        return TYPE_INDEX[self.name]

    def read_label(self, qid: str, option_ids: Sequence[str], label: Any) -> str:
        """A raw eval label as its option id; ``InvalidLabel`` (field ``labels.<qid>``) when it is none of
        ``option_ids`` (prompt order)."""
        found = _LABEL_READERS[self.label](option_ids, label)
        if found is None:
            words = {Label.BOOLEAN: f"a {self.name} label is {' or '.join(option_ids)}, not {label!r:.60}",
                     Label.OPTION: f"{self.name} label {label!r:.60} is not one of its options {list(option_ids)[:20]}",
                     Label.LEVEL: f"{self.name} label {label!r:.60} is not a level 0..{len(option_ids) - 1}"}
            raise errors.InvalidLabel(f"{qid}: {words[self.label]}", field=f"labels.{qid}")
        return found

    def label_of(self, option_id: str) -> Any:
        """The label that names ``option_id`` (``read_label``'s inverse): bool, option id or level."""
        return _LABEL_WRITERS[self.label]([oid for oid, _ in self.fixed], option_id)


def _boolean(ids: Sequence[str], label: Any) -> str | None:
    if isinstance(label, bool):
        return ids[0] if label else ids[1]
    return label.lower() if isinstance(label, str) and label.lower() in ids else None


def _option(ids: Sequence[str], label: Any) -> str | None:
    return label if isinstance(label, str) and label in ids else None


def _level(ids: Sequence[str], label: Any) -> str | None:
    level: int | None = None
    if isinstance(label, int) and not isinstance(label, bool):
        level = label
    elif isinstance(label, str) and label.strip().isdigit():
        try:
            level = int(label)
        except ValueError:  # digits int() does not read (superscripts)
            level = None
    return None if level is None or not 0 <= level < len(ids) else str(level)


_LABEL_READERS: dict[Label, Callable[[Sequence[str], Any], str | None]] = {
    Label.BOOLEAN: _boolean, Label.OPTION: _option, Label.LEVEL: _level}
_LABEL_WRITERS: dict[Label, Callable[[Sequence[str], str], Any]] = {  # (the fixed options, the option)
    Label.BOOLEAN: lambda fixed, option_id: option_id == fixed[0], Label.OPTION: lambda fixed, option_id: option_id,
    Label.LEVEL: lambda fixed, option_id: int(option_id)}

_CHOICE_COUNTS, _SCORE_COUNTS = (2, 255), (2, 10)

# ---------------------------------------------------------------- the registry, in type_embedding order
NOUL = QuestionType(
    "noul", Criteria.FIXED, (AnswerKey("noul", Part.FIRST, "P(true)"),), Label.BOOLEAN,
    criteria_doc="criteria: optional descriptions of the answers true and false",
    summary="yes/no, answered with P(yes)",
    text="noul p(true)={noul:.4f}", mcp_line="noul {noul}",
    fixed=(("true", "The proposition is true or the answer is yes."),
           ("false", "The proposition is false or the answer is no.")))
CHOICE = QuestionType(
    "choice", Criteria.NAMED,
    (AnswerKey("choice", Part.WINNER), AnswerKey("confidence", Part.CONFIDENCE),
     AnswerKey("probabilities", Part.PROBABILITIES, "option id -> probability, in request order")), Label.OPTION,
    criteria_doc="criteria: option id -> description (any JSON value), reported in request order;\n"
                 f"options.strict: {_CHOICE_COUNTS[0]}-{_CHOICE_COUNTS[1]} options",
    summary="pick one of `criteria` (option id -> description), answered with the choice, its confidence and "
            "every option's probability",
    text="{choice} (confidence {confidence:.4f})", mcp_line="choice {choice} ({confidence})",
    counts=_CHOICE_COUNTS, too_few="a choice needs at least {lo_word} options (got {n})",
    too_many="at most {hi} options per choice (got {n})")
SCORE = QuestionType(
    "score", Criteria.LEVELS,
    (AnswerKey("score", Part.EXPECTED_LEVEL, "the expected level"), AnswerKey("confidence", Part.CONFIDENCE),
     AnswerKey("legend", Part.LEGEND, "level -> its description as sent"),
     AnswerKey("probabilities", Part.PROBABILITIES)), Label.LEVEL,
    criteria_doc=f"criteria: level descriptions, lowest first; options.strict: {_SCORE_COUNTS[0]}-{_SCORE_COUNTS[1]} "
                 "levels",
    summary="a level of `criteria` (a list, lowest first), answered with the expected level 0..n-1, the likeliest "
            "level's probability and every level's",
    text="score {score:.4f} (confidence {confidence:.4f})", mcp_line="score {score} ({likeliest}, {confidence})",
    counts=_SCORE_COUNTS, too_few="a score takes {lo} to {hi} levels (got {n})",
    too_many="a score takes {lo} to {hi} levels (got {n})")

TYPES: tuple[QuestionType, ...] = (NOUL, CHOICE, SCORE)  # the order of the head's type_embedding rows

QUESTION_TYPES = tuple(t.name for t in TYPES)
TYPE_INDEX = {name: i for i, name in enumerate(QUESTION_TYPES)}  # row of type_embedding
_BY_NAME = dict(zip(QUESTION_TYPES, TYPES))
CHOICE_OPTIONS, SCORE_LEVELS = _CHOICE_COUNTS, _SCORE_COUNTS
ONE_OF = ", ".join(QUESTION_TYPES[:-1]) + f", or {QUESTION_TYPES[-1]}"  # "noul, choice, or score"


def unknown_type(name: Any, field: str | None) -> errors.InvalidQuestionType:
    return errors.InvalidQuestionType(f"type must be {ONE_OF} (got {name!r})", field=field)


def question_type(name: Any, field: str | None = None) -> QuestionType:
    """The registry's entry for ``name``; ``InvalidQuestionType`` naming ``field`` for any other."""
    found = _BY_NAME.get(name) if isinstance(name, str) else None
    if found is None:
        raise unknown_type(name, field)
    return found


class Indexable(Protocol):
    """A list, a tuple or a NumPy vector."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


def winner(probabilities: Indexable) -> int:
    """Which option won: the index of the highest probability, the first of tied maxima in the order
    given. Answers and evidence give the report order (a choice's request order), so the first option
    the request names wins a tie; eval rows list options in prompt order (clef-finetune's metrics)."""
    return max(range(len(probabilities)), key=probabilities.__getitem__)
