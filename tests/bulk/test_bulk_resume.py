"""A batch job killed mid-way (SIGKILL, SIGTERM: real child processes) and resumed gives the
same output as an uninterrupted run: no id twice, none missing. And its progress output."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import termios

import pyarrow.parquet as pq
import pytest

from bulk_helpers import (DEADLINE_S, lines, run_batch, start_batch, wait_for_lines,
                          write_schema, write_states)

N = 150
KILL_AFTER = 30  # records written before the kill


@pytest.fixture(scope="module")
def job(tiny_model_dir, tmp_path_factory):
    """The input, the schema, and the output of one uninterrupted run."""
    base = tmp_path_factory.mktemp("resume")
    src = write_states(base / "in.jsonl", N, bad_at=(70,))
    schema = write_schema(base / "q.json")
    proc = run_batch(tiny_model_dir, "-i", str(src), "-o", str(base / "ref.jsonl"),
                     "-q", str(schema), "--window", "4")
    assert proc.returncode == 0, proc.stderr
    return src, schema, base / "ref.jsonl"


def _evidence(name: str, before: int, out_lines: list[dict], reference: list[dict]) -> None:
    ids = [r["id"] for r in out_lines]
    duplicates = len(ids) - len(set(ids))
    missing = len({r["id"] for r in reference} - set(ids))
    print(f"\n{name}: {before} records before the kill, {len(ids)} after the resume, "
          f"{duplicates} duplicates, {missing} missing")
    assert duplicates == 0 and missing == 0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_and_resumed_equals_an_uninterrupted_run(tiny_model_dir, job, tmp_path, sig):
    src, schema, reference = job
    out = tmp_path / "out.jsonl"
    args = ("-i", str(src), "-o", str(out), "-q", str(schema), "--window", "4")
    proc = start_batch(tiny_model_dir, *args)
    wait_for_lines(out, KILL_AFTER, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=DEADLINE_S)
    before = len(lines(out))
    assert KILL_AFTER <= before < N, "the job was not stopped mid-way"
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM
        assert "stopped by SIGTERM" in err and "run the same command again" in err
    else:
        assert proc.returncode == -signal.SIGKILL
    resumed = run_batch(tiny_model_dir, *args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{before} already done" in resumed.stderr
    _evidence(sig.name, before, lines(out), lines(reference))
    assert out.read_bytes() == reference.read_bytes()  # same records, same order, same bytes


def test_parquet_killed_and_resumed(tiny_model_dir, job, tmp_path):
    src, schema, reference = job
    ref_parquet = tmp_path / "ref.parquet"
    args = ("-i", str(src), "-q", str(schema), "--window", "4")
    assert run_batch(tiny_model_dir, *args, "-o", str(ref_parquet)).returncode == 0
    out = tmp_path / "out.parquet"
    journal = tmp_path / "out.parquet.journal.jsonl"
    proc = start_batch(tiny_model_dir, *args, "-o", str(out))
    wait_for_lines(journal, KILL_AFTER, proc)
    proc.kill()
    proc.communicate(timeout=DEADLINE_S)
    before = len(lines(journal))
    assert not out.exists() and before < N
    resumed = run_batch(tiny_model_dir, *args, "-o", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert not journal.exists()
    table = pq.read_table(out).to_pylist()
    _evidence("parquet SIGKILL", before, table, lines(reference))
    assert table == pq.read_table(ref_parquet).to_pylist()


def test_progress_bar_on_a_terminal_and_lines_in_a_log(tiny_model_dir, job, tmp_path):
    src, schema, _ = job
    master, slave = pty.openpty()
    # a new pty is 0 columns wide: size it like a terminal window, or the bar has no room
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = start_batch(tiny_model_dir, "-i", str(src), "-o", str(tmp_path / "tty.jsonl"),
                       "-q", str(schema), stderr=slave)
    os.close(slave)
    seen = b""
    while True:  # read until the child closes its end (EIO on Linux)
        ready, _, _ = select.select([master], [], [], DEADLINE_S)
        if not ready:
            break
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert proc.wait(DEADLINE_S) == 0
    text = seen.decode(errors="replace")
    assert "\r" in text and "%|" in text and "rec/s" in text and "tok/s" in text  # tqdm's bar
    assert f"{N - 1} answered, 1 failed" in text

    logged = run_batch(tiny_model_dir, "-i", str(src), "-o", str(tmp_path / "log.jsonl"),
                       "-q", str(schema), "--log-every", "0", "--window", "50")
    assert logged.returncode == 0
    progress = [ln for ln in logged.stderr.splitlines() if "records (" in ln]
    assert progress and "records/s" in progress[0] and "ETA" in progress[0]
    assert "\r" not in logged.stderr
