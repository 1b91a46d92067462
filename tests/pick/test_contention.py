"""The machine's load during the speed probe (``pick.contention``): real processes measured by the meter, the
kernel groups that tell a measurement out of line, which of two measurements is kept, and what ``pick``
does with a table taken under load (measured again once quiet, said in its output)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest

from clef_gguf.pick import command as pick
from clef_gguf.pick import contention, speed
from clef_gguf.core.limits import GiB
from clef_gguf.models.machine import DeviceProfile
from machine_helpers import X86

SPIN = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\nprint('done', flush=True)"


def _spin(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)], stdout=subprocess.PIPE, text=True)


def test_the_meter_counts_the_childs_work_as_its_own_and_anothers_as_load():
    child = _spin(1.0)
    meter = contention.Meter(child.pid, threads=1)
    child.stdout.readline()
    quiet = meter.lap()
    child.wait()
    assert quiet.seconds >= 0.9 and quiet.others < 0.3  # the child's own core is not load

    child, other = _spin(1.5), _spin(2.5)  # another process spinning beside the probe
    meter = contention.Meter(child.pid, threads=psutil_cores())
    child.stdout.readline()
    busy = meter.lap()
    child.wait(), other.wait()
    assert busy.others > 0.6 and busy.contended == pytest.approx(busy.others) and busy.loaded
    assert busy.to_dict()["other_cores"] == round(busy.others, 2)


def psutil_cores() -> int:
    import psutil

    return psutil.cpu_count() or 1


def test_only_the_cores_the_probe_uses_count():
    assert contention.contended_cores(1.0, threads=1, cores=2) == 0.0  # one busy core, one free: no contention
    assert contention.contended_cores(1.0, threads=2, cores=2) == 1.0
    assert contention.contended_cores(2.5, threads=4, cores=4) == 2.5
    assert not contention.Window(1.0, 0.9, 0.2).loaded and contention.Window(1.0, 0.9, 0.3).loaded


def test_contention_now_sees_a_spinning_process():
    other = _spin(2.0)
    try:
        time.sleep(0.2)
        assert contention.contention_now(psutil_cores(), sample=0.5) > 0.6
    finally:
        other.wait()


def test_a_quant_far_from_its_kernel_group_is_out_of_line():
    # The table an overloaded probe kept (issue 36): Q5_K_S 4.3x Q5_K_M; Q4_0 against its own kind
    seconds = {"Q5_K_M": 15.6, "Q5_K_S": 66.3, "Q4_K_M": 14.9, "Q6_K": 17.0, "IQ4_XS": 13.4, "IQ2_M": 14.0,
               "Q8_0": 32.1, "Q4_0": 67.4, "Q5_0": 30.0, "Q5_1": 60.0, "Q4_1": 55.0, "BF16": 70.0}
    assert contention.out_of_line(seconds) == {"Q5_K_S", "Q4_0"}
    # different kernels may differ: Q5_1 is 4x Q4_K_M here and in line with Q4_1; BF16 has no group
    assert [contention.kernel_group(q) for q in ("Q5_K_S", "IQ1_S", "IQ4_NL", "Q5_1", "BF16")] == \
        ["k", "iq", "q_0", "q_1", "BF16"]
    assert contention.out_of_line({"Q4_K_M": 1.0}) == set()


def _row(runs, loaded, tokens=64):
    return {"quant": "Q4_K_M", "probe_tokens": tokens, "probe_runs": runs, "loaded": loaded,
            "load": {"contended_cores": 1.0 if loaded else 0.0}}


def test_of_two_measurements_the_quiet_one_else_the_faster_is_kept():
    slow_busy, quiet = _row([2.0, 2.1], True), _row([1.0, 1.1], False)
    assert contention.kept(slow_busy, quiet) == {**quiet, "remeasured": True}
    assert contention.kept(quiet, _row([0.5], True))["probe_runs"] == [1.0, 1.1]  # a loaded run is not trusted
    assert contention.kept(_row([2.0], False), _row([1.0], False))["probe_runs"] == [1.0]
    assert contention.kept(_row([2.0], True), _row([3.0], True)) == {**_row([2.0], True), "remeasured": True}
    assert contention.kept(quiet, None) == quiet
    assert contention.kept(quiet, {"quant": "Q4_K_M", "error": "boom"}) == quiet


# ---------------------------------------------------------------------------- the real probe, under load

@pytest.fixture
def small_family(monkeypatch, tmp_path):
    monkeypatch.setattr(speed, "preset_for", {"clef-flash": "small"}.get)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(pick, "probe", lambda **_: DeviceProfile(32 * GiB, 26 * GiB, 2, "x86_64", X86))


def test_a_probe_taken_under_load_says_so_and_is_measured_again_when_quiet(small_family, capsys, monkeypatch):
    """Every core spinning in other processes through the probe: each quant is timed twice (under load
    both times), the table says so, and the next pick, on a quiet machine, measures them again."""
    spinners = [_spin(60) for _ in range(psutil_cores())]
    try:
        table = speed.measure("clef-flash", ["Q4_K_M"], tokens=128, threads=psutil_cores())
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    row = table.quants["Q4_K_M"]
    assert row.loaded and row.remeasured and row.load["contended_cores"] > contention.LOADED_CORES
    assert table.loaded_quants == ("Q4_K_M",)
    assert json.loads(json.dumps(table.to_dict()))["loaded_quants"] == ["Q4_K_M"]

    # the kept table, read back: still marked; pick says so, and reads it again on a quiet machine
    kept = speed.cached(table.key)
    assert kept.loaded_quants == ("Q4_K_M",)
    monkeypatch.setattr(contention, "contention_now", lambda threads, sample=0.5: 2.0)  # still busy: kept
    again = speed.measure("clef-flash", ["Q4_K_M"], tokens=128, threads=psutil_cores())
    assert again.cached and again.loaded_quants == ("Q4_K_M",)
    assert pick.run(pick_args("--quants", "Q4_K_M", "--tokens", "128", "--threads", str(psutil_cores()))) == 0
    out = capsys.readouterr().out
    assert "Under load" in out and "Q4_K_M were timed (twice each)" in out and "(timed under load)" in out

    monkeypatch.setattr(contention, "contention_now", lambda threads, sample=0.5: 0.0)  # quiet now
    quiet = speed.measure("clef-flash", ["Q4_K_M"], tokens=128, threads=psutil_cores())
    assert not quiet.cached and quiet.loaded_quants == () and not quiet.quants["Q4_K_M"].remeasured


def test_an_out_of_line_quant_is_measured_again(small_family, monkeypatch):
    """A kept table whose Q4_K_S reads 100x Q4_K_M's: the new Q4_K_M is in line, but a Q5_K_M probed now
    against a kept Q4_K_M far faster than anything is out of line, and measured twice."""
    first = speed.measure("clef-flash", ["Q4_K_M"], tokens=128, threads=1)
    fast = dataclasses.replace(first.quants["Q4_K_M"], probe_seconds=first.quants["Q4_K_M"].probe_seconds / 100)
    monkeypatch.setattr(speed, "cached", lambda key: dataclasses.replace(first, quants={"Q4_K_M": fast}, cached=True))
    table = speed.measure("clef-flash", ["Q4_K_M", "Q5_K_M"], tokens=128, threads=1)
    assert table.quants["Q5_K_M"].remeasured and not table.quants["Q4_K_M"].remeasured


def pick_args(*argv):
    import argparse

    parser = argparse.ArgumentParser()
    pick.add_arguments(parser)
    return parser.parse_args(list(argv))
