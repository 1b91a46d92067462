"""The batch input: JSONL or Parquet, read as ``Record``s in input order.

JSONL: one JSON object per line, either a whole SystemOne request or ``{"id", "state", ...}``
completed by the shared ``--questions`` schema (a line's own ``questions`` win). Parquet: a
``state`` column, an optional ``id`` column and an optional image column, ``images`` (a list per
row) or ``image`` (one per row, null: none); the questions come from ``--questions``. An image value
is what a request's ``images`` holds (a data: URI, base64, a path or a URL) or, in a binary column,
the image file's bytes, sent on as a ``data:`` URI. Videos and ``media_kwargs`` need JSONL.

A record's id is its ``id`` (a non-empty string or a whole number, kept as a string), else its
0-based line or row number as a string. Blank lines are not records but keep their number, so ids
do not move when a blank line is added or removed. A line that cannot be read becomes a record
carrying its error: the job answers the rest.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_gguf.core import errors
from clef_gguf.core.deps import need
from clef_gguf.core.errors import DuplicateId, InvalidInput
from clef_gguf.pipeline.request import parse_json, parse_request

PARQUET_SUFFIXES = frozenset({".parquet", ".pq"})
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json"})
PARQUET_BATCH_ROWS = 1024  # rows decoded at once: bounded memory whatever the file's size
PARQUET_MEDIA_BATCH_ROWS = 32  # the same with pictures in the rows (a few MB each)
PARQUET_IMAGE_COLUMNS = ("images", "image")  # a list per row, or one picture per row
# (offset, leading bytes, media type): the data: URI a binary image value becomes says what it is;
# anything else goes as image/unknown and the decoder refuses it for that record only.
IMAGE_SIGNATURES = ((0, b"\x89PNG\r\n\x1a\n", "image/png"), (0, b"\xff\xd8\xff", "image/jpeg"),
                    (0, b"GIF8", "image/gif"), (8, b"WEBP", "image/webp"))


@dataclass(frozen=True)
class Record:
    index: int  # 0-based line (JSONL) or row (Parquet) number
    id: str
    request: dict | None  # the SystemOne request, the record's id taken out
    error: dict | None = None  # {"error": {...}} when the record could not be read

    def transport(self) -> dict:
        """The record as plain strings and ints (what Ray Data carries between processes)."""
        import json

        return {"index": self.index, "id": self.id,
                "request": "" if self.request is None else json.dumps(self.request),
                "error": "" if self.error is None else json.dumps(self.error)}


def format_of(path: str | Path, default: str | None = None) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in JSONL_SUFFIXES or default is None:
        return "jsonl"
    return default


def load_schema(path: str | Path) -> dict:
    """``--questions``: a JSON object of questions, checked now so that a bad schema fails the
    job before the model loads rather than every record after."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise errors.InvalidValue(f"cannot read the questions file: {exc.strerror}: {path}",
                                  field="questions") from None
    schema = parse_json(raw)
    if not isinstance(schema, dict):
        raise errors.InvalidValue("the questions file must hold one JSON object of questions "
                                  '({"id": {"type": "noul"}, ...})', field="questions")
    parse_request({"state": "", "questions": schema})
    return schema


def read(path: str | Path, fmt: str, schema: dict | None, *,
         ids_only: bool = False) -> Iterator[Record]:
    """Every record of the input, in order. ``ids_only`` skips building requests (the id scan)."""
    if fmt == "parquet":
        if schema is None:
            raise errors.MissingField("a Parquet input holds states only: give the questions "
                                      "with --questions SCHEMA.json", field="questions")
        return _parquet(Path(path), schema, ids_only)
    return _jsonl(Path(path), schema)


def index_ids(path: str | Path, fmt: str, schema: dict | None) -> dict[str, int]:
    """id -> record index over the whole input; two records with one id are refused here,
    before any model is loaded."""
    seen: dict[str, int] = {}
    for record in read(path, fmt, schema, ids_only=True):
        first = seen.setdefault(record.id, record.index)
        if first != record.index:
            what = "line" if fmt == "jsonl" else "row"
            raise DuplicateId(f"id {record.id!r} is used by {what}s {first} and {record.index} "
                              f"(a record without an id is named by its 0-based {what} number); "
                              "give every record its own id", field="id")
    return seen


def _jsonl(path: Path, schema: dict | None) -> Iterator[Record]:
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise InvalidInput(f"cannot read the input: {exc.strerror}: {path}", field="input") \
            from None
    with f:
        for index, raw in enumerate(f):
            line = raw.rstrip(b"\r\n")
            if not line.strip():
                continue
            try:
                obj = parse_json(line)
            except errors.ClefError as exc:
                yield Record(index, str(index), None, exc.to_dict())
                continue
            yield _record(index, obj, schema)


def _record(index: int, obj: Any, schema: dict | None) -> Record:
    if not isinstance(obj, dict):
        return Record(index, str(index), None, errors.InvalidValue(
            "a line must be a JSON object: a SystemOne request, or {\"id\", \"state\"} with "
            "--questions").to_dict())
    request = dict(obj)
    record_id = _id(request.pop("id", None), index)
    if isinstance(record_id, errors.ClefError):
        return Record(index, str(index), None, record_id.to_dict())
    if schema is not None and "questions" not in request:
        request["questions"] = schema
    return Record(index, record_id, request)


def _id(value: Any, index: int) -> str | errors.ClefError:
    if value is None:
        return str(index)
    # bool is an int to Python, and 1.0 would print as "1.0": neither is a usable id
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        return errors.InvalidValue(f"a record id is a non-empty string or a whole number, not "
                                   f"{type(value).__name__} {value!r:.40}", field="id")
    return str(value)


def _parquet(path: Path, schema: dict, ids_only: bool) -> Iterator[Record]:
    pq = need("pyarrow.parquet", "parquet")
    try:
        table = pq.ParquetFile(path)
    except OSError as exc:
        raise InvalidInput(f"cannot read the input: {exc}: {path}", field="input") from None
    except Exception as exc:  # pyarrow's ArrowInvalid: not a Parquet file
        raise InvalidInput(f"{path} is not a readable Parquet file: {exc}", field="input") \
            from None
    names = set(table.schema_arrow.names)
    if "state" not in names:
        raise InvalidInput(f"{path} has no 'state' column (columns: {', '.join(sorted(names))})",
                           field="state")
    media = [c for c in PARQUET_IMAGE_COLUMNS if c in names]
    if len(media) > 1:
        raise InvalidInput(f"{path} has both an 'images' and an 'image' column: keep one",
                           field="images")
    columns = [c for c in ("id", "state", *media) if c in names and not (ids_only and c != "id")]
    return _parquet_rows(table, columns, schema)


def _parquet_rows(table: Any, columns: list[str], schema: dict) -> Iterator[Record]:
    index = 0
    if not columns:  # the id scan of a table without ids: row numbers
        for index in range(table.metadata.num_rows):
            yield Record(index, str(index), None)
        return
    rows = PARQUET_MEDIA_BATCH_ROWS if set(columns) & set(PARQUET_IMAGE_COLUMNS) else PARQUET_BATCH_ROWS
    for batch in table.iter_batches(batch_size=rows, columns=columns):
        for row in batch.to_pylist():
            record_id = _id(row.get("id"), index)
            if isinstance(record_id, errors.ClefError):
                yield Record(index, str(index), None, record_id.to_dict())
            else:
                yield Record(index, record_id, _row_request(row, schema) if "state" in row else None)
            index += 1


def _row_request(row: dict[str, Any], schema: dict) -> dict[str, Any]:
    """A Parquet row as a request: its state, the shared questions, and its images."""
    request: dict[str, Any] = {"state": row["state"], "questions": schema}
    value = row.get("images", row.get("image"))
    if "image" in row:
        value = None if value is None else [value]
    elif isinstance(value, (bytes, str)):  # an 'images' column of single values
        value = [value]
    if value:
        request["images"] = [image_uri(v) if isinstance(v, bytes) else v for v in value]
    return request


def image_uri(data: bytes) -> str:
    """An image file's bytes as the ``data:`` URI a request carries."""
    kind = next((mime for at, lead, mime in IMAGE_SIGNATURES if data[at:at + len(lead)] == lead),
                "image/unknown")
    return f"data:{kind};base64," + base64.b64encode(data).decode("ascii")
