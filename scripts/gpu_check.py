"""The GPU check: one JSON report of every row of ``gpu_rows.ROWS``, in priority order, within a deadline.

    python scripts/gpu_check.py --report REPORT.json [--deadline 480] [--dry-run] [--rows a,b] [--variant NAME]

Each row runs in a process of its own (``--row NAME``: a crash or a hang is that row's, and the deadline
can stop it), its result written into the report as soon as it is measured. A row that cannot start, or
finish, before the deadline is ``skipped``, which is not a failure; the exit status is 1 when a row
``failed``. ``--dry-run`` runs every row's code on the CPU at the tiny shapes (the test suite does), so
a GPU run is never spent on a typo. ``scripts/gpu-check.sh BUNDLE`` installs the offline bundle and runs
this from a directory that holds no ``clef_gguf/`` source folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_rows  # noqa: E402 - beside this script, not a package

SCHEMA = "clef-gguf-gpu-check/1"
STATUSES = ("passed", "failed", "measured", "skipped")
DEFAULT_DEADLINE_S = 480  # 8 minutes of a 15-minute lease, start-up and a rerun's margin aside


def write(path: Path, report: dict) -> None:
    """The report as it stands, replaced whole (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def run_row(name: str, work: Path, dry: bool, left: float) -> dict:
    """One row in a child process, stopped at ``left`` seconds; its dict, or why it has none."""
    cmd = [sys.executable, __file__, "--row", name, "--work", str(work)] + (["--dry-run"] if dry else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=max(1.0, left))
    except subprocess.TimeoutExpired:
        return {"status": "skipped", "reason": f"the deadline came {left:.0f} s into the row"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"status": "failed", "reason": f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
    row = json.loads(lines[-1])
    if row.get("status") not in STATUSES:
        return {"status": "failed", "reason": f"no status in {row!r}"[:500]}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", type=Path, help="the JSON report to write (default: gpu-check-report.json)")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S, help="seconds for all the rows")
    p.add_argument("--dry-run", action="store_true", help="every row on the CPU at the tiny shapes")
    p.add_argument("--rows", help="only these rows, comma-separated (default: all, in priority order)")
    p.add_argument("--variant", default=os.environ.get("CLEF_GPU_VARIANT", "default"),
                   help="the llama.cpp build variant this bundle is (flash attention on, FORCE_CUBLAS...)")
    p.add_argument("--row", help=argparse.SUPPRESS)  # the child: run one row, print its JSON
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [name for name, _, _ in gpu_rows.ROWS]
    if args.row:
        fn = dict((n, f) for n, f, _ in gpu_rows.ROWS)[args.row]
        print(json.dumps(fn(args.work, args.dry_run)))
        return 0
    wanted = names if not args.rows else [r.strip() for r in args.rows.split(",")]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        p.error(f"unknown rows {unknown}: choose from {', '.join(names)}")
    start = time.monotonic()
    report_path = args.report or Path("gpu-check-report.json")
    now = datetime.datetime.now(datetime.timezone.utc)
    report: dict = {"schema": SCHEMA, "started": now.isoformat(timespec="seconds"),
                    "deadline_s": args.deadline, "dry_run": args.dry_run, "variant": args.variant,
                    "rows": [{"name": n, "priority": i + 1, "status": "pending"} for i, n in enumerate(wanted)],
                    "finished": False}
    write(report_path, report)
    with tempfile.TemporaryDirectory(prefix="clef-gpu-check-", dir=os.environ.get("CLEF_GPU_WORK")) as work:
        for entry in report["rows"]:
            estimate = next(e for n, _, e in gpu_rows.ROWS if n == entry["name"])
            left = args.deadline - (time.monotonic() - start)
            t0 = time.monotonic()
            if left < (1 if args.dry_run else min(estimate, 60)):  # no time to start it
                row = {"status": "skipped", "reason": f"{left:.0f} s left before the deadline"}
            else:
                row = run_row(entry["name"], Path(work), args.dry_run, left)
            entry.update(row, seconds=round(time.monotonic() - t0, 1))
            write(report_path, report)
            print(f"{entry['name']}: {entry['status']} ({entry['seconds']} s)", file=sys.stderr, flush=True)
    report["finished"] = True
    report["failed"] = [r["name"] for r in report["rows"] if r["status"] == "failed"]
    report["seconds"] = round(time.monotonic() - start, 1)
    write(report_path, report)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
