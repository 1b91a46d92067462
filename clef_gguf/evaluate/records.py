"""The labelled input: clef-finetune 0.1.0's JSONL, a SystemOne request plus ``"labels"`` per line.

``{"id": "c1", "state": ..., "questions": {...}, "labels": {"fraud": false, "severity": 2}}``

Labels follow clef-finetune's ``data.normalize_label``: noul ``true``/``false`` or
``"true"``/``"false"`` (any case), choice an option id, score a level index or its digit string.
A question without a label is asked but not scored. A record is named by its 0-based line number
(resume) and reported under its ``id`` as written (None when it has none, as clef-finetune does).
A line that cannot be read, or a label that is not one of its question's options, is reported and
skipped: the other records, and the record's other labels, are still scored. A record's ``images`` and
``videos`` are asked like the rest of its request (paths relative to the data file: ``predict``).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clef_gguf.core import errors
from clef_gguf.pipeline.request import Question, Request, parse_json


@dataclass(frozen=True)
class LabelledRecord:
    index: int  # 0-based line number
    record_id: Any  # the line's "id" as written, None without one
    request: dict | None  # the SystemOne request: "id" and "labels" taken out
    labels: dict[str, Any] = field(default_factory=dict)
    error: dict | None = None  # {"error": {...}} when the line cannot be used at all


def lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """Every line of a JSONL file with its 0-based number, through gzip when the name ends in ``.gz``;
    ``InvalidInput`` naming the file when it cannot be read (missing, not gzip, corrupt or cut short)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            yield from enumerate(f)
    except OSError as exc:  # gzip.BadGzipFile is an OSError
        raise _unreadable(path, exc.strerror or str(exc)) from None
    except EOFError:
        raise _unreadable(path, "it ends early (a truncated .gz file)") from None
    except zlib.error as exc:  # a damaged deflate stream inside a valid gzip header
        raise _unreadable(path, f"its compressed data is corrupt ({exc})") from None


def _unreadable(path: str | Path, why: str) -> errors.InvalidInput:
    return errors.InvalidInput(f"cannot read the data file {path}: {why}", field="data")


def first_row(path: str | Path) -> Any:
    """The first non-blank line as JSON, or None when there is none or it cannot be read or parsed."""
    try:
        raw = next((line for _, line in lines(path) if line.strip()), b"")
        return json.loads(raw)
    except (errors.InvalidInput, ValueError):
        return None


def read(path: str | Path) -> Iterator[LabelledRecord]:
    """Every non-blank line of ``path`` (``.jsonl``, or ``.jsonl.gz``), in order."""
    for index, raw in lines(path):
        if raw.strip():
            yield _record(index, raw.rstrip(b"\r\n"))


def _record(index: int, line: bytes) -> LabelledRecord:
    try:
        obj = parse_json(line)
    except errors.ClefError as exc:
        return LabelledRecord(index, None, None, error=exc.to_dict())
    if not isinstance(obj, dict):
        return LabelledRecord(index, None, None, error=errors.InvalidValue(
            "a line must be a JSON object: a SystemOne request with \"labels\"").to_dict())
    request = dict(obj)
    record_id = request.pop("id", None)
    labels = request.pop("labels", None)
    if labels is None:
        labels = {}
    if not isinstance(labels, dict):
        return LabelledRecord(index, record_id, None, error=errors.InvalidLabel(
            f"labels must be an object {{question_id: label}}, not {type(labels).__name__}",
            field="labels").to_dict())
    return LabelledRecord(index, record_id, request, labels)


def option_ids(question: Question) -> list[str]:
    """Option ids in encode order (noul: true, false; choice: sorted by key; score: by level)."""
    return [option.id for option in question.options]


def normalize_label(question: Question, label: Any) -> str:
    """A raw label as its option id, as its type's registry entry reads labels (``core.questions``:
    noul a boolean, choice an option id, score a level); ``InvalidLabel`` when it is none of the
    question's, ``InvalidQuestionType`` for a type nobody registered."""
    return question.question_type.read_label(question.id, option_ids(question), label)


def targets(request: Request, labels: dict[str, Any]) -> tuple[dict[str, int], list[dict]]:
    """(question id -> target option index, the errors of the labels that could not be used)."""
    questions = {q.id: q for q in request.questions}
    found: dict[str, int] = {}
    problems: list[dict] = []
    for qid, label in labels.items():
        question = questions.get(qid)
        try:
            if question is None:
                raise errors.InvalidLabel(f"a label for {qid!r:.60}, which is not one of the "
                                          "record's questions", field=f"labels.{qid}")
            found[qid] = option_ids(question).index(normalize_label(question, label))
        except errors.InvalidLabel as exc:
            problems.append(exc.to_dict())
    return found, problems
