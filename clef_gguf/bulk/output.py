"""The batch output: one record per input record, appended and fsynced as it is answered, and
what a rerun with the same output finds already done.

A record is ``{"id", "model", "answers", "usage", "audit"[, "warnings"][, "truncated"][, "evidence"]}`` or
``{"id", "error": {code, message, field}}``. ``usage.cached_tokens`` and ``usage.cached_media_tokens``
are left out: they say what the caches held, so without them the output is a function of the input
alone (a resumed run, a rerun and the Ray engine write the same bytes).

JSONL output is the journal itself. Parquet cannot be appended to, so its records go to a JSONL
journal beside it (``OUT.journal.jsonl``) and the table is rewritten from the previous table plus
the journal, in input order, when the job stops; a kill before that leaves the journal, which the
next run continues. Either way, a kill loses no record that was written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

from clef_gguf.core.deps import need
from clef_gguf.core.errors import CorruptOutput, InvalidValue

# Parquet columns: objects as JSON text (answers differ in shape from one schema to the next, so
# a struct column would not fit them all): df["answers"].map(json.loads) reads them back.
JSON_COLUMNS = ("answers", "usage", "audit", "warnings", "error")
PARQUET_WRITE_ROWS = 10_000


# What a response's usage says of the caches, not of the request.
CACHE_USAGE = ("cached_tokens", "cached_media_tokens")


def output_record(record_id: str, response: dict) -> dict:
    out = {"id": record_id, **response}
    usage = out.get("usage")
    if isinstance(usage, dict) and any(k in usage for k in CACHE_USAGE):
        out["usage"] = {k: v for k, v in usage.items() if k not in CACHE_USAGE}
    return out


def encode(record: dict) -> bytes:
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


class Journal:
    """Append-only JSONL: each record is written with one ``write``, flushed and fsynced before
    the next one is computed, so a crash can only cut the line being written (dropped on resume)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        data = memoryview(encode(record))
        while data:
            data = data[os.write(self._fd, data):]
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_journal(path: Path) -> list[dict]:
    """The complete records of a JSONL output; a line cut by a crash (no newline) is removed
    from the file, so that the next record starts on a line of its own."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
            os.fsync(f.fileno())
    records = []
    for number, line in enumerate(complete.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise CorruptOutput(f"line {number} of {path} is not a batch record; clef-gguf "
                                "appends to this file: give a new --output or repair it",
                                field="output")
        records.append(record)
    return records


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` whole through a temporary file: a crash leaves the old file or the new."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Output:
    """``open()`` -> ids already done; ``write(record)`` per record; ``close(order)`` at the end."""

    def __init__(self, path: str | Path, fmt: str, *, retry_errors: bool = False) -> None:
        self.path, self.fmt, self.retry_errors = Path(path), fmt, retry_errors
        self.journal_path = (self.path if fmt == "jsonl"
                             else self.path.with_name(self.path.name + ".journal.jsonl"))
        self.journal: Journal | None = None

    def open(self) -> dict[str, bool]:
        """Resume: the id of every record already written -> whether it is an error. With
        ``retry_errors``, error records are dropped first and their ids are not done."""
        previous = {row["id"]: row["error"] is not None for row in self._table_rows()}
        written = read_journal(self.journal_path)
        if self.retry_errors and any("error" in r for r in written):
            kept = [r for r in written if "error" not in r]
            _replace(self.journal_path, lambda tmp: tmp.write_bytes(b"".join(map(encode, kept))))
            written = kept
        previous.update((r["id"], "error" in r) for r in written)
        self.journal = Journal(self.journal_path)
        return {k: err for k, err in previous.items() if not (err and self.retry_errors)}

    def write(self, record: dict) -> None:
        if self.journal is None:
            raise RuntimeError("Output.write before Output.open")
        if self.fmt == "parquet" and "evidence" in record:  # no column holds it: say so, drop nothing silently
            record = {"id": record["id"], "error": InvalidValue(
                "evidence is written to JSONL output only; give --output a .jsonl name",
                field="evidence").to_dict()["error"]}
        self.journal.write(record)

    def close(self, order: dict[str, int] | None = None) -> None:
        """Parquet: rewrite the table from the last one plus the journal, in input order (ids the
        input no longer has go last), then remove the journal. JSONL: nothing left to do."""
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        if self.fmt != "parquet" or not self.journal_path.exists():
            return
        rows = {row["id"]: row for row in self._table_rows()}
        rows.update((r["id"], parquet_row(r)) for r in read_journal(self.journal_path))
        order = order or {}
        ranked = sorted(enumerate(rows.values()),
                        key=lambda pair: (order.get(pair[1]["id"], len(order) + pair[0])))
        _replace(self.path, lambda tmp: write_parquet(tmp, [row for _, row in ranked]))
        self.journal_path.unlink()

    def _table_rows(self) -> list[dict]:
        if self.fmt != "parquet" or not self.path.exists():
            return []
        pq = need("pyarrow.parquet", "parquet")
        try:
            table = pq.read_table(self.path)
        except Exception as exc:  # ArrowInvalid and friends: not a table we wrote
            raise CorruptOutput(f"{self.path} is not a readable Parquet file ({exc}); give a new "
                                "--output", field="output") from None
        if set(table.schema.names) != set(parquet_schema().names):
            raise CorruptOutput(f"{self.path} is not a clef-gguf batch output (columns: "
                                f"{', '.join(table.schema.names)})", field="output")
        return table.to_pylist()


def parquet_schema() -> Any:  # a pyarrow.Schema (pyarrow is optional)
    pa = need("pyarrow", "parquet")
    return pa.schema([("id", pa.string()), ("model", pa.string()), ("answers", pa.string()),
                      ("usage", pa.string()), ("audit", pa.string()), ("warnings", pa.string()),
                      ("truncated", pa.bool_()), ("error", pa.string()),
                      ("error_code", pa.string())])


def parquet_row(record: dict) -> dict[str, Any]:
    """One output record as a table row: objects as JSON text, absent ones null."""
    row: dict[str, Any] = {"id": record["id"], "model": record.get("model")}
    for name in JSON_COLUMNS:
        value = record.get(name)
        row[name] = None if value is None else json.dumps(value, ensure_ascii=False)
    row["truncated"] = None if "error" in record else bool(record.get("truncated", False))
    error = record.get("error")
    row["error_code"] = error.get("code") if isinstance(error, dict) else None
    return row


def write_parquet(path: Path, rows: list[dict]) -> None:
    pa, pq = need("pyarrow", "parquet"), need("pyarrow.parquet", "parquet")
    schema = parquet_schema()
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, max(len(rows), 1), PARQUET_WRITE_ROWS):
            writer.write_table(pa.Table.from_pylist(rows[start:start + PARQUET_WRITE_ROWS],
                                                    schema=schema))
