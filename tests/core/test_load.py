"""The machine's load beside a measurement (``core.load``): the arithmetic of contention, and the meter on
real processes. The meter's tests measure the live machine, so they assert only what holds under any
load (other processes spinning on every core included): the measured processes' work is their own,
to the counters' precision, and another process's work is never counted as theirs."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from clef_gguf.core import load

SPIN = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\nprint('done', flush=True)"
CORES = psutil.cpu_count() or 1


def _spin(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)], stdout=subprocess.PIPE, text=True)


def test_only_the_cores_the_measurement_uses_count():
    assert load.contended_cores(1.0, threads=1, cores=2) == 0.0  # one busy core, one free: no contention
    assert load.contended_cores(1.0, threads=2, cores=2) == 1.0
    assert load.contended_cores(2.5, threads=4, cores=4) == 2.5
    assert not load.Window(1.0, 0.9, 0.2).loaded and load.Window(1.0, 0.9, 0.3).loaded
    assert load.Window(2.0, 1.234, 1.0).to_dict() == {"seconds": 2.0, "other_cores": 1.23, "contended_cores": 1.0}


def test_a_run_is_as_loaded_as_its_worst_window():
    windows = [load.Window(1.0, 0.1, 0.1), load.Window(1.0, 1.5, 1.5), load.Window(1.0, 0.0, 0.0)]
    assert load.worst(windows) == windows[1] and load.worst([]) is None


@pytest.mark.live_machine
def test_the_meter_counts_the_childs_work_as_its_own_under_any_load():
    """A child spinning for a second: its CPU time is the window's own work, whatever else runs."""
    child = _spin(1.0)
    proc = psutil.Process(child.pid)
    meter = load.Meter(threads=CORES, pid=child.pid)
    child.stdout.readline()  # it has spun its second and is exiting (a zombie keeps its counters)
    spent = sum(proc.cpu_times()[:2])
    window = meter.lap()
    child.wait()
    assert window.seconds >= 0.9 and window.own * window.seconds == pytest.approx(spent, abs=0.15)
    assert window.own + window.others <= CORES + 0.2  # nothing counted twice


@pytest.mark.live_machine
def test_another_processs_work_is_load_under_any_load():
    """A second process spinning beside the measured child is others' work: at least its share of the
    cores (more when the machine is busier still), and never the child's own."""
    child, other = _spin(1.5), _spin(2.5)
    meter = load.Meter(threads=CORES, pid=child.pid)
    child.stdout.readline()
    busy = meter.lap()
    child.wait(), other.wait()
    # the two spinners (and whatever else runs) share the cores: the other one had at least 1/(n+1) of
    # them, n the processes that wanted one; with two more spinners on 2 cores that is a third of a core
    assert busy.others > 0.3 and busy.contended == pytest.approx(busy.others) and busy.loaded


@pytest.mark.live_machine
def test_contention_now_sees_a_spinning_process_under_any_load():
    other = _spin(2.0)
    try:
        time.sleep(0.2)
        assert load.contention_now(CORES, sample=0.5) > load.LOADED_CORES
    finally:
        other.wait()
