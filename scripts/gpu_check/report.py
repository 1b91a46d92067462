"""The GPU check's report: one JSON file, rewritten whole at every change, and the measurement lines a
row prints on its stdout the moment it takes each measurement (``record``), which ``run`` writes into it.

The report (schema ``SCHEMA``): when it started, the deadline, whether it is a dry run, the offline
variables the rows ran with, each row's planned seconds, what the bundle says of itself, and the rows in
priority order, each ``pending``, ``running`` or one of ``STATUSES`` with its data and ``measured`` (what
it recorded); at the end ``finished``, ``failed`` (the rows that did) and ``seconds``.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

SCHEMA = "clef-gguf-gpu-check/2"
STATUSES = ("passed", "failed", "measured", "skipped", "cut")
MEASURE = "measure"  # the key of a measurement line on a row's stdout


def record(key: str, value: Any) -> Any:
    """One measurement, out at once (the runner writes it into the report); returns ``value``."""
    print(json.dumps({MEASURE: key, "value": value}), flush=True)
    return value


def measurement(msg: Any) -> tuple[str, Any] | None:
    """``(key, value)`` of a measurement line's JSON, or None for any other line."""
    if isinstance(msg, dict) and MEASURE in msg:
        return msg[MEASURE], msg.get("value")
    return None


def write(path: Path, report: dict) -> None:
    """The report as it stands, replaced whole (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def bundle() -> dict | None:
    """What the installed bundle says of itself (gpu-bundle.sh's BUILD.json), where gpu-check.sh names one."""
    path = os.environ.get("CLEF_GPU_BUNDLE")
    return json.loads(Path(path).read_text(encoding="utf-8")) if path and Path(path).is_file() else None


def start(deadline: float, dry: bool, offline_env: dict[str, str], planned: dict[str, float]) -> dict:
    """The report before any row runs: ``planned`` (name: planned seconds) in priority order, all pending."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"schema": SCHEMA, "started": now.isoformat(timespec="seconds"),
            "deadline_s": deadline, "dry_run": dry, "offline_env": offline_env,
            "planned_s": dict(planned), "bundle": bundle(),
            "rows": [{"name": n, "priority": i + 1, "status": "pending"} for i, n in enumerate(planned)],
            "finished": False}


def finish(report: dict, seconds: float) -> None:
    """The report once every row is done: ``finished``, the rows that ``failed``, the run's ``seconds``."""
    report["finished"] = True
    report["failed"] = [r["name"] for r in report["rows"] if r["status"] == "failed"]
    report["seconds"] = round(seconds, 1)
