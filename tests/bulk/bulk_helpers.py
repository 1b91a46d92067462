"""Inputs for the batch tests and a runner for ``clef-gguf batch`` as a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 120.0

SCHEMA = {"overdue": {"type": "noul", "instructions": "Is the invoice overdue?"},
          "action": {"type": "choice", "criteria": {"remind": "Send a reminder",
                                                    "escalate": "Escalate to collections"}},
          "risk": {"type": "score", "criteria": ["low", "medium", "high"]}}
OTHER = {"refund": {"type": "noul", "instructions": "Should we refund?"}}


def state(i: int) -> str:
    return f"Invoice INV-{i} for ${10 * i}.00 is {i % 45} days past due."


def write_states(path: Path, n: int, *, bad_at: tuple[int, ...] = ()) -> Path:
    """``{"id", "state"}`` lines (for --questions); a malformed line at each ``bad_at``."""
    with open(path, "w") as f:
        for i in range(n):
            f.write("{not json\n" if i in bad_at else
                    json.dumps({"id": f"inv-{i}", "state": state(i)}) + "\n")
    return path


def write_schema(path: Path, schema: dict = SCHEMA) -> Path:
    path.write_text(json.dumps(schema))
    return path


def lines(path: Path) -> list[dict]:
    """The complete lines (a line a kill cut short has no newline yet: the resume drops it)."""
    data = path.read_bytes()
    return [json.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines()]


def batch_cmd(model: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "clef_gguf.cli", "batch", "--model", str(model),
            "--threads", "1", "--max-length", "2048", *args]


def run_batch(model: Path, *args: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    return subprocess.run(batch_cmd(model, *args), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=_env())


def _env() -> dict:
    # one thread for torch as for llama.cpp: steadier on a shared 2-core machine
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def start_batch(model: Path, *args: str, stderr=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen(batch_cmd(model, *args), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env=_env())


def wait_for_lines(path: Path, at_least: int, proc: subprocess.Popen) -> int:
    """Poll the output until it has ``at_least`` complete lines (bounded); return the count."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        count = path.read_bytes().count(b"\n") if path.exists() else 0
        if count >= at_least:
            return count
        if proc.poll() is not None:
            raise AssertionError(f"batch ended (rc {proc.returncode}) before {at_least} lines")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {at_least} output lines")
