"""The speed probe's child process, run and read: ``speed_run`` in a process of its own (a ggml abort in
one quant's quantizer must not take ``pick`` down), its lines read as they come, each quant's window of
machine load (``core.load.Meter``) recorded beside its measurement, the deadline kept."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clef_gguf.core.children import LineReader, module_command
from clef_gguf.core import load

TAIL_CHARS = 2000  # of the child's stderr, kept for a failure's message


@dataclass
class ChildResult:
    rows: dict[str, dict] = field(default_factory=dict)  # per quant, with its "load" window
    head: float | None = None
    picture_tokens: int | None = None
    picture_seconds: float | None = None
    tail: str = ""  # the last process's stderr, for a failure's message


def _one_process(spec_path: Path, env: dict[str, str], deadline: float, threads: int,
                 take: Any) -> str:
    """Run speed_run on ``spec_path``, handing ``take(obj, window)`` each JSON line as it is printed;
    returns the tail of its stderr (or why it was stopped)."""
    proc = subprocess.Popen(module_command("clef_gguf.pick.speed_run", str(spec_path)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", env=env)
    assert proc.stdout is not None and proc.stderr is not None
    meter = load.Meter(threads, pid=proc.pid)
    lines = LineReader(proc.stdout)
    err: list[str] = []
    errors_read = threading.Thread(target=lambda: err.extend(proc.stderr or ()), daemon=True)
    errors_read.start()
    stopped = None
    try:
        while True:
            try:
                line = lines.get(deadline - time.monotonic())
            except queue.Empty:
                stopped = "the probe ran out of time"
                break
            if line is None:
                break
            window = meter.lap()  # before wait(): an exited child's counters are still there
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                take(obj, window)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        lines.join(timeout=5)
        errors_read.join(timeout=5)
    return stopped or "".join(err)[-TAIL_CHARS:]


def run(spec: dict[str, Any], deadline: float, threads: int, known: ChildResult | None = None) -> ChildResult:
    """Run speed_run on ``spec``. A quant that killed the process is recorded as failed and the rest
    run in a fresh one, told what the first already measured (and ``known``: an earlier run's head and
    picture, not timed again)."""
    got = ChildResult()
    if known is not None:
        got.head, got.picture_tokens, got.picture_seconds = known.head, known.picture_tokens, known.picture_seconds
    todo = list(spec["quants"])
    env = dict(os.environ, GGML_NO_BACKTRACE="1")

    def take(obj: dict, window: Any) -> None:
        if "head_seconds" in obj:
            got.head = float(obj["head_seconds"])
        elif "picture_tokens" in obj:
            got.picture_tokens, got.picture_seconds = int(obj["picture_tokens"]), float(obj["picture_seconds"])
        elif obj.get("quant") in todo:
            got.rows[obj["quant"]] = {**obj, "load": window.to_dict(), "loaded": window.loaded}

    while todo:
        spec_path = Path(spec["workdir"]) / "spec.json"
        spec_path.write_text(json.dumps({**spec, "quants": todo, "head_known": got.head is not None,
                                         "picture_tokens": got.picture_tokens}))
        if deadline - time.monotonic() <= 0:
            break
        got.tail = _one_process(spec_path, env, deadline, threads, take)
        rest = [q for q in todo if q not in got.rows]
        if rest:  # the process ended (or timed out) inside rest[0]
            got.rows[rest[0]] = {"quant": rest[0], "error": f"the probe process stopped: {got.tail.strip()[-200:]}"}
        todo = rest[1:]
    return got
