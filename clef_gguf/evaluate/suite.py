"""The Decision Index's suite files as ``eval`` input, read as they are: ``selected-rows.jsonl.gz``,
``added-rows.jsonl.gz`` or a plain ``.jsonl`` of the same rows.

A row is ``{"id"?, "family"?, "track"?, "state", "questions", "expected", "metadata"?, "scoring"?,
"_evaluation"?}``: ``state`` and ``questions`` are the request (nothing else is sent to the model),
``expected`` its labels (question id -> option key; noul true/false; score a level), ``family`` and
``track`` name its benchmark. ``metadata``, ``scoring`` and ``_evaluation`` stay here: the metric names a
row's ``scoring`` declares that answers alone cannot give (nDCG@10, Brier against forecasts...) are
reported as not computed. Unlike clef-finetune's files, where a bad line is skipped and reported, a
malformed row stops the eval with its row number (1-based line) and field: a benchmark with rows
silently missing would not be the benchmark.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_gguf.core import errors
from clef_gguf.evaluate.records import LabelledRecord, first_row, lines, normalize_label
from clef_gguf.pipeline.request import parse_json, parse_request

REQUEST_KEYS = ("state", "questions")
KEPT_BACK = ("metadata", "scoring", "_evaluation")  # never sent to the model
# What eval computes from answers; any other metric a row's ``scoring`` names is "not computed".
COMPUTED = ("accuracy", "macro_f1", "case_exact", "coverage")
_SCORING_KEYS = ("metric", "metrics", "primary_metric", "secondary_metrics")


@dataclass(frozen=True)
class Suite:
    """The rows as eval's labelled records (``index``: the 0-based line), each row's benchmark, and per
    benchmark the metrics its rows' ``scoring`` names that eval does not compute."""

    records: list[LabelledRecord]
    benchmarks: dict[int, str]
    not_computed: dict[str, list[str]]


def is_suite(path: str | Path) -> bool:
    """Whether the first row is a suite row: it names a benchmark (``family``/``track``) or carries
    ``expected``, and has no ``labels`` (clef-finetune's), whether or not the file is gzipped."""
    row = first_row(path)  # None when unreadable: the labelled reader says what is wrong with it
    return isinstance(row, dict) and "labels" not in row and any(k in row for k in ("expected", "family", "track"))


def _bad(path: Path, row: int, field: str, problem: str) -> errors.InvalidInput:
    return errors.InvalidInput(f"{path.name}, row {row}: {field}: {problem}", field=field)


def _benchmark(path: Path, row: int, obj: dict[str, Any]) -> str:
    names = []
    for key in ("family", "track"):
        value = obj.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            raise _bad(path, row, key, f"a benchmark name (a non-empty string), not {value!r:.60}")
        names.append(value.strip())
    if not names:
        raise _bad(path, row, "family", "missing: each row names its benchmark by family or track")
    return "/".join(dict.fromkeys(names))


def _declared(scoring: Any) -> list[str]:
    """Metric names a row's ``scoring`` declares (a name, a list, or an object's metric keys)."""
    if isinstance(scoring, str):
        return [scoring]
    if isinstance(scoring, list):
        return [s for s in scoring if isinstance(s, str)]
    if isinstance(scoring, dict):
        return [name for key in _SCORING_KEYS for name in _declared(scoring.get(key))]
    return []


def _row(path: Path, index: int, raw: bytes) -> tuple[LabelledRecord, str, list[str]]:
    row = index + 1
    try:
        obj = parse_json(raw)
    except errors.ClefError as exc:
        raise _bad(path, row, "row", f"not one JSON object ({exc.message})") from None
    if not isinstance(obj, dict):
        raise _bad(path, row, "row", f"a JSON object, not {type(obj).__name__}")
    for key in REQUEST_KEYS:
        if key not in obj:
            raise _bad(path, row, key, "missing")
    request = {key: obj[key] for key in REQUEST_KEYS}
    try:
        parsed = parse_request(request)
    except errors.ClefError as exc:
        raise _bad(path, row, exc.field or "questions", exc.message) from None
    expected = obj.get("expected")
    if not isinstance(expected, dict) or not expected:
        raise _bad(path, row, "expected", "an object {question_id: option key}, not "
                   f"{json.dumps(expected)[:60]}")
    questions = {q.id: q for q in parsed.questions}
    for qid, label in expected.items():
        if qid not in questions:
            raise _bad(path, row, f"expected.{qid}", f"names no question of the row (it has "
                       f"{', '.join(list(questions)[:10])})")
        try:
            normalize_label(questions[qid], label)
        except errors.InvalidLabel as exc:
            raise _bad(path, row, f"expected.{qid}", exc.message) from None
    record = LabelledRecord(index, obj.get("id", row), request, dict(expected))
    return record, _benchmark(path, row, obj), _declared(obj.get("scoring"))


def read(path: str | Path) -> Suite:
    """Every non-blank row of ``path``, in order; ``InvalidInput`` naming the row and field of the first
    malformed one."""
    path = Path(path)
    records: list[LabelledRecord] = []
    benchmarks: dict[int, str] = {}
    declared: dict[str, dict[str, None]] = {}
    for index, raw in lines(path):
        if not raw.strip():
            continue
        record, benchmark, metrics = _row(path, index, raw.rstrip(b"\r\n"))
        records.append(record)
        benchmarks[index] = benchmark
        names = declared.setdefault(benchmark, {})
        names.update(dict.fromkeys(m for m in metrics if m.lower().replace("-", "_") not in COMPUTED))
    return Suite(records, benchmarks, {b: list(names) for b, names in declared.items()})
