"""Measurements a busy machine spoiled (``pick.outliers``): the kernel groups that tell a measurement out of
line, which of two measurements is kept, and what ``pick`` does with a table taken under load (measured
again once quiet, said in its output). The machine's load is the ``machine_load`` fixture's: these tests
hold on a machine under any load."""

from __future__ import annotations

import dataclasses
import json

import pytest

from clef_gguf.core.limits import GiB
from clef_gguf.models.machine import DeviceProfile
from clef_gguf.pick import command as pick
from clef_gguf.pick import outliers, speed
from machine_helpers import X86


def test_a_quant_far_from_its_kernel_group_is_out_of_line():
    # The table a probe kept while a build held both cores: Q5_K_S 4.3x Q5_K_M; Q4_0 against its own kind
    seconds = {"Q5_K_M": 15.6, "Q5_K_S": 66.3, "Q4_K_M": 14.9, "Q6_K": 17.0, "IQ4_XS": 13.4, "IQ2_M": 14.0,
               "Q8_0": 32.1, "Q4_0": 67.4, "Q5_0": 30.0, "Q5_1": 60.0, "Q4_1": 55.0, "BF16": 70.0}
    assert outliers.out_of_line(seconds) == {"Q5_K_S", "Q4_0"}
    # different kernels may differ: Q5_1 is 4x Q4_K_M here and in line with Q4_1; BF16 has no group
    assert [outliers.kernel_group(q) for q in ("Q5_K_S", "IQ1_S", "IQ4_NL", "Q5_1", "BF16")] == \
        ["k", "iq", "q_0", "q_1", "BF16"]
    assert outliers.out_of_line({"Q4_K_M": 1.0}) == set()


def _row(runs, loaded, tokens=64):
    return {"quant": "Q4_K_M", "probe_tokens": tokens, "probe_runs": runs, "loaded": loaded,
            "load": {"contended_cores": 1.0 if loaded else 0.0}}


def test_of_two_measurements_the_quiet_one_else_the_faster_is_kept():
    slow_busy, quiet = _row([2.0, 2.1], True), _row([1.0, 1.1], False)
    assert outliers.kept(slow_busy, quiet) == {**quiet, "remeasured": True}
    assert outliers.kept(quiet, _row([0.5], True))["probe_runs"] == [1.0, 1.1]  # a loaded run is not trusted
    assert outliers.kept(_row([2.0], False), _row([1.0], False))["probe_runs"] == [1.0]
    assert outliers.kept(_row([2.0], True), _row([3.0], True)) == {**_row([2.0], True), "remeasured": True}
    assert outliers.kept(quiet, None) == quiet
    assert outliers.kept(quiet, {"quant": "Q4_K_M", "error": "boom"}) == quiet


# ---------------------------------------------------------------------------- the real probe, under load

@pytest.fixture
def small_family(monkeypatch, tmp_path, machine_load):
    monkeypatch.setattr(speed, "preset_for", {"clef-flash": "small"}.get)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(pick, "probe", lambda **_: DeviceProfile(32 * GiB, 26 * GiB, 2, "x86_64", X86))
    return machine_load


def test_a_probe_taken_under_load_says_so_and_is_measured_again_when_quiet(small_family, capsys):
    """Every core busy with other processes through the probe: each quant is timed twice (under load
    both times), the table says so, and the next pick, on a quiet machine, measures them again."""
    small_family.busy(2.0)
    table = speed.measure("clef-flash", ["Q4_K_M"], tokens=128, threads=2)
    row = table.quants["Q4_K_M"]
    assert row.loaded and row.remeasured and row.load["contended_cores"] == 2.0
    assert table.loaded_quants == ("Q4_K_M",)
    assert json.loads(json.dumps(table.to_dict()))["loaded_quants"] == ["Q4_K_M"]

    # the kept table, read back: still marked; while the machine stays busy pick keeps it and says so
    kept = speed.cached(table.key)
    assert kept.loaded_quants == ("Q4_K_M",)
    again = speed.measure("clef-flash", ["Q4_K_M"], tokens=128, threads=2)
    assert again.cached and again.loaded_quants == ("Q4_K_M",)
    assert pick.run(pick_args("--quants", "Q4_K_M", "--tokens", "128", "--threads", "2")) == 0
    out = capsys.readouterr().out
    assert "Under load" in out and "Q4_K_M were timed (twice each)" in out and "(timed under load)" in out

    small_family.quiet()  # once quiet, the loaded quant is measured again, once
    quiet = speed.measure("clef-flash", ["Q4_K_M"], tokens=128, threads=2)
    assert not quiet.cached and quiet.loaded_quants == () and not quiet.quants["Q4_K_M"].remeasured
    assert speed.measure("clef-flash", ["Q4_K_M"], tokens=128, threads=2).cached


def test_an_out_of_line_quant_is_measured_again(small_family, monkeypatch):
    """A kept table whose Q4_K_M reads 100x faster than anything: a Q5_K_M probed now against it is out of
    line, and measured twice; the kept Q4_K_M is not."""
    first = speed.measure("clef-flash", ["Q4_K_M"], tokens=128, threads=1)
    fast = dataclasses.replace(first.quants["Q4_K_M"], probe_seconds=first.quants["Q4_K_M"].probe_seconds / 100)
    monkeypatch.setattr(speed, "cached", lambda key: dataclasses.replace(first, quants={"Q4_K_M": fast}, cached=True))
    table = speed.measure("clef-flash", ["Q4_K_M", "Q5_K_M"], tokens=128, threads=1)
    assert table.quants["Q5_K_M"].remeasured and not table.quants["Q4_K_M"].remeasured
    assert not table.quants["Q5_K_M"].loaded


def pick_args(*argv):
    import argparse

    parser = argparse.ArgumentParser()
    pick.add_arguments(parser)
    return parser.parse_args(list(argv))
