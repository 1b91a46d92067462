"""The local engine: records -> output records, in input order, through ``Clef.decide_many``.

Records are taken ``window`` at a time; within a window, ``decide_many`` runs the requests about
one state one after another so the state cache decodes it once. A record the reader could not
read keeps its error and never reaches the model. The Ray engine runs this same function in each
actor, so both engines compute each record the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from clef_gguf import errors
from clef_gguf.errors import InternalError
from clef_gguf.bulk.output import output_record
from clef_gguf.bulk.records import Record

log = logging.getLogger("clef_gguf.bulk")


def results(clef: Any, records: Iterable[Record], *, window: int = 64,
            truncate_state: bool = False) -> Iterator[dict]:
    chunk: list[Record] = []
    for record in records:
        chunk.append(record)
        if len(chunk) == window:
            yield from _window(clef, chunk, truncate_state)
            chunk = []
    if chunk:
        yield from _window(clef, chunk, truncate_state)


def _window(clef: Any, chunk: list[Record], truncate_state: bool) -> Iterator[dict]:
    readable = [r.request for r in chunk if r.error is None]
    try:
        answers = iter(list(clef.decide_many(readable, truncate_state=truncate_state,
                                             window=max(len(readable), 1))))
    except Exception:  # a fault outside ClefError (a bug): find its record, answer the others
        log.exception("a window of %d records failed; answering them one at a time", len(chunk))
        answers = (_one(clef, request, truncate_state) for request in readable)
    for record in chunk:
        yield output_record(record.id, record.error if record.error is not None else next(answers))


def _one(clef: Any, request: dict, truncate_state: bool) -> dict:
    try:
        return clef.decide(request, truncate_state=truncate_state)
    except errors.ClefError as exc:
        return exc.to_dict()
    except Exception as exc:
        log.exception("a record failed")
        return InternalError(f"{type(exc).__name__}: {exc}").to_dict()
