"""The GPU check: one JSON report of the rows of ``rows.ROWS``, in priority order, within a deadline.

    python scripts/gpu_check --report REPORT.json [--deadline 480] [--kernels-s 180] [--dry-run] [--rows a,b]

Each row runs in a process group of its own (``--row NAME``: a crash or a hang is that row's, and the
deadline ends it with every process it started). A row prints each measurement as it takes it; the
report (``report``) is rewritten at once, so a row cut off by the deadline keeps what it measured (status
``cut``). A row whose declared cost (planned seconds on a 16-core GPU host) does not fit in the time left
is ``skipped`` before it starts. ``--deadline`` bounds every row but ``kernels``, which runs last within
its own ``--kernels-s`` (``clef-gguf tune`` on the GPU). Neither ``skipped`` nor ``cut`` is a failure;
the exit status is 1 when a row ``failed``. ``--dry-run`` runs every row's code on the CPU at the tiny
shapes (the test suite does), with no cost check. ``scripts/gpu-check.sh BUNDLE`` installs the offline
bundle and runs this from a directory that holds no ``clef_gguf/`` source folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from clef_gguf.core.children import LineReader
from gpu_check import command, report as reports, rows as table
from gpu_check.report import STATUSES

DEFAULT_DEADLINE_S = 480  # 8 minutes for every row but kernels, which has a budget of its own
KILL_GRACE_S = 5.0  # SIGTERM to SIGKILL of a row's process group
# The check is offline by design: no hub, no telemetry, whatever the caller's environment says.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
Clock = Callable[[], float]


@dataclass(frozen=True)
class Step:
    """What the plan does with one row: run it within ``budget`` seconds, or skip it and why."""

    name: str
    run: bool
    budget: float
    reason: str = ""


def plan_row(row: table.Row, left: float, dry: bool) -> Step:
    """Run ``row`` with ``left`` seconds to go, or skip it: its cost must fit (the dry run: any time left)."""
    need = 1.0 if dry else row.cost_s
    if left < need:
        return Step(row.name, False, 0.0, f"{left:.0f} s left before the deadline, the row plans {need:.0f} s")
    return Step(row.name, True, left)


def rows_module(path: str | None) -> Any:
    """``rows``, or the module at ``path`` (the tests' rows: the same protocol, seconds long)."""
    if not path:
        return table
    spec = importlib.util.spec_from_file_location("gpu_rows_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _end_group(proc: subprocess.Popen) -> None:
    """Ends the row's whole process group (its server, probe, quantizer...): TERM, a grace, then KILL;
    it returns once no process of the group is left, not just the row's own."""
    for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # nothing left in the group
        if _group_gone(proc, grace):
            break
    proc.wait()


def _group_gone(proc: subprocess.Popen, within: float) -> bool:
    """Whether every process of ``proc``'s group has ended within ``within`` seconds (the row reaped
    here, its children by whoever adopted them)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        proc.poll()  # a leader nobody waited for would keep the group alive as a zombie
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def run_row(name: str, work: Path, dry: bool, left: float, entry: dict, save: Callable[[], None],
            rows_from: str | None = None, clock: Clock = time.monotonic) -> dict:
    """One row in a process group of its own, ended at ``left`` seconds; each measurement it prints
    goes into ``entry["measured"]`` and ``save()`` at once. Its result, or why it has none."""
    cmd = command("--row", name, "--work", str(work)) + (["--dry-run"] if dry else [])
    cmd += ["--rows-from", rows_from] if rows_from else []
    err = tempfile.TemporaryFile(mode="w+")
    # HF_HOME in the run's folder: pick's speed table and tune's winners for the random models stay there
    env = {**os.environ, **OFFLINE_ENV, "HF_HOME": str(work / "hf")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, errors="replace",
                            start_new_session=True, env=env)
    end = clock() + left
    final: dict | None = None
    lines = LineReader(proc.stdout)
    cut = False
    try:
        while True:
            remaining = end - clock()
            if remaining <= 0:
                cut = True
                break
            try:
                line = lines.get(min(remaining, 1.0))
            except queue.Empty:
                continue
            if line is None:
                break
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue  # a library's print on stdout
            measured = reports.measurement(msg)
            if measured is not None:
                entry.setdefault("measured", {})[measured[0]] = measured[1]
                save()
            elif isinstance(msg, dict) and "status" in msg:
                final = msg
    finally:
        if not cut:  # the row's last line is out: let it exit by itself before its group is ended
            try:
                proc.wait(max(0.0, min(end - clock(), 30.0)))
            except subprocess.TimeoutExpired:
                pass
        _end_group(proc)
        # the group is gone and the pipe's writers with it; one that left the group keeps the reader (a
        # daemon) in its read, and closing the stream under it would wait on that read
        if lines.join(5.0):
            proc.stdout.close()
    err.seek(0)
    stderr = err.read().strip()
    err.close()
    if cut:
        return {"status": "cut", "reason": f"the deadline came {left:.0f} s into the row; what it measured "
                "before is under measured"}
    if proc.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL) or final is None:
        return {"status": "failed", "reason": f"exit {proc.returncode}: {stderr[-1500:]}"}
    if final.get("status") not in STATUSES:
        return {"status": "failed", "reason": f"no status in {final!r}"[:500]}
    return final


def child(module: Any, name: str, work: Path, dry: bool) -> int:
    """The ``--row`` process: the row's final dict as the last line of stdout."""
    fn = {row.name: row.fn for row in module.ROWS}[name]
    print(json.dumps(fn(work, dry)), flush=True)
    return 0


def main(argv: list[str] | None = None, clock: Clock = time.monotonic, runner: Callable[..., dict] = run_row) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check", description=__doc__.splitlines()[0],
                                epilog="`python scripts/gpu_check nvfp4-backend`: the nvfp4 backend's own check")
    p.add_argument("--report", type=Path, help="the JSON report to write (default: gpu-check-report.json)")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                   help=f"seconds for every row but kernels (default {DEFAULT_DEADLINE_S})")
    p.add_argument("--kernels-s", type=float, default=None,
                   help="seconds for the kernels row, after the others (default: its planned cost)")
    p.add_argument("--dry-run", action="store_true", help="every row on the CPU at the tiny shapes")
    p.add_argument("--rows", help="only these rows, comma-separated (default: all, in priority order)")
    p.add_argument("--row", help=argparse.SUPPRESS)  # the child: run one row, print its JSON
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--rows-from", help=argparse.SUPPRESS)  # the tests' rows module
    args = p.parse_args(argv)
    module = rows_module(args.rows_from)
    if args.row:
        return child(module, args.row, args.work, args.dry_run)
    rows = {row.name: row for row in module.ROWS}
    wanted = list(rows) if not args.rows else [r.strip() for r in args.rows.split(",")]
    unknown = sorted(set(wanted) - set(rows))
    if unknown:
        p.error(f"unknown rows {unknown}: choose from {', '.join(rows)}")
    wanted = [name for name in rows if name in wanted]  # always in priority order
    os.environ.update(OFFLINE_ENV)
    start = clock()
    report_path = args.report or Path("gpu-check-report.json")
    report = reports.start(args.deadline, args.dry_run, OFFLINE_ENV, {n: rows[n].cost_s for n in wanted})
    reports.write(report_path, report)
    with tempfile.TemporaryDirectory(prefix="clef-gpu-check-", dir=os.environ.get("CLEF_GPU_WORK")) as work:
        kernels_start = None
        for entry in report["rows"]:
            row = rows[entry["name"]]
            if row.after_deadline:  # its own budget, from when the others are done
                kernels_start = kernels_start if kernels_start is not None else clock()
                own = args.kernels_s if args.kernels_s is not None else row.cost_s
                left = own - (clock() - kernels_start)
            else:
                left = args.deadline - (clock() - start)
            step = plan_row(row, left, args.dry_run)
            t0 = clock()
            if not step.run:
                result = {"status": "skipped", "reason": step.reason}
            else:
                entry["status"] = "running"
                reports.write(report_path, report)
                result = runner(row.name, Path(work), args.dry_run, step.budget, entry,
                                lambda: reports.write(report_path, report), args.rows_from, clock)
            entry.update(result, seconds=round(clock() - t0, 1))
            reports.write(report_path, report)
            print(f"{entry['name']}: {entry['status']} ({entry['seconds']} s)", file=sys.stderr, flush=True)
    reports.finish(report, clock() - start)
    reports.write(report_path, report)
    return 1 if report["failed"] else 0
