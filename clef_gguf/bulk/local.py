"""The local engine: records -> output records, in input order, through ``clef_gguf.runtime.engine``.

Records are taken ``window`` at a time; within a window, the engine runs the requests about one
state one after another so the state cache decodes it once, and a record that fails, however it
fails, gets its error in its place while the others are answered. A record the reader could not
read keeps its error and never reaches the model. The Ray engine runs this same function in each
actor, so both engines compute each record the same way. Images and videos are read under
``media_policy`` (the job's: local paths relative to the input file's directory).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from clef_gguf.runtime import engine
from clef_gguf.bulk.output import output_record
from clef_gguf.bulk.records import Record
from clef_gguf.media.sources import MediaPolicy


def results(clef: engine.Model, records: Iterable[Record], *, window: int = engine.WINDOW,
            truncate_state: bool = False, media_policy: MediaPolicy | None = None) -> Iterator[dict]:
    for chunk in engine.windows(records, window):
        readable = [r.request for r in chunk if r.error is None]
        answers = iter(engine.answer(clef, readable, truncate_state=truncate_state,
                                     media_policy=media_policy))
        for record in chunk:
            yield output_record(record.id,
                                record.error if record.error is not None else next(answers))
