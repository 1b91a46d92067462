"""core.children.LineReader: every line of a child's output reaches the reader, those that came in one
write included, and a wait for a line honours its timeout."""

import queue
import subprocess
import sys

import pytest

from clef_gguf.core.children import LineReader


def test_lines_written_together_all_arrive_then_the_end():
    code = "import sys, time; sys.stdout.write('a\\nb\\n'); sys.stdout.flush(); time.sleep(1)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    lines = LineReader(proc.stdout)
    assert [lines.get(10), lines.get(10)] == ["a\n", "b\n"]
    assert lines.get(10) is None  # the child exited: the end
    proc.wait()
    lines.join(5)
    proc.stdout.close()


def test_a_wait_with_nothing_to_read_times_out():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    lines = LineReader(proc.stdout)
    try:
        with pytest.raises(queue.Empty):
            lines.get(0.2)
    finally:
        proc.kill()
        proc.wait()
    assert lines.get(10) is None
    proc.stdout.close()
