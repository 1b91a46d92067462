"""``pick``'s speed probe: the choice rules on a faked probe result, and the real probe (at the ~110M
preset's shapes, so it takes seconds) through pick's command line, its cache and its refusals."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import pytest

from machine_helpers import X86
from clef_gguf.cli import main
from clef_gguf.core import errors
from clef_gguf.core.errors import InvalidValue
from clef_gguf.pick import command as pick
from clef_gguf.pick import speed
from clef_gguf.core.limits import GiB
from clef_gguf.models.machine import DeviceProfile
from clef_gguf.models.placement import recommend

BOX = DeviceProfile(32 * GiB, 26 * GiB, 2, "x86_64", X86)
SECONDS = {"Q8_0": 20.0, "Q6_K": 16.0, "Q5_K_M": 14.0, "Q4_K_M": 11.0, "IQ4_XS": 10.5, "Q2_K": 9.0}


def fake_table(seconds: dict[str, float] = SECONDS, **kw) -> speed.SpeedTable:
    quants = {q: speed.QuantSpeed(q, 128, (s / 29,), s / 29 * 464 / 128, s - 0.07, s, round(500 / (s - 0.07), 2))
              for q, s in seconds.items()}
    quants["IQ1_S"] = speed.QuantSpeed("IQ1_S", error="RuntimeError: no such type here")
    return speed.SpeedTable(**{"family": "clef-flash", "preset": "flash9b", "tokens": 500, "threads": 2,
                               "gpu_layers": {}, "layers": 32, "probe_layers": 4, "head_seconds": 0.07,
                               "quants": quants, "key": "k", "measured_at": "now", "took_seconds": 60.0, **kw})


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    pick.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def faked(monkeypatch):
    """pick on a fixed 32 GiB box with a faked probe; returns the calls the probe got."""
    calls = []

    def measure(family, quants, **kw):
        calls.append((family, list(quants), kw))
        return fake_table()
    monkeypatch.setattr(pick, "probe", lambda **_: BOX)
    monkeypatch.setattr(speed, "measure", measure)
    return calls


def test_max_seconds_takes_the_most_accurate_quant_within_the_limit(faked, capsys):
    assert pick.run(parse("--max-seconds", "12")) == 0
    out = capsys.readouterr().out
    assert "Recommended: clef-flash:Q4_K_M (on CPU)" in out
    assert "Q4_K_M is the most accurate quant that fits within 12 s: predicted 11.0 s" in out
    assert "Speed here: a decision of 500 tokens with 2 threads, measured now in 60 s." in out
    row = next(line for line in out.splitlines() if line.strip().startswith("Q8_0 "))
    assert row.split()[-2:] == ["20.0", "25"]
    assert "probe failed: RuntimeError: no such type here" in out
    family, quants, kw = faked[0]
    assert family == "clef-flash" and "Q4_K_M" in quants and "BF16" not in quants  # BF16 is never CPU-fit
    assert kw["tokens"] == 500 and kw["threads"] >= 1 and not kw["reprobe"]


def test_prefer_speed_takes_the_fastest_and_json_has_the_table(faked, capsys):
    assert pick.run(parse("--prefer", "speed", "--json", "--tokens", "800", "--threads", "1", "--reprobe")) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommendation"]["quant"] == "Q2_K"
    assert "fastest quant that fits" in data["recommendation"]["reason"]
    rows = {r["quant"]: r for r in data["table"]}
    assert rows["Q6_K"]["seconds"] == 16.0 and rows["Q6_K"]["fits"] and rows["BF16"]["seconds"] is None
    assert data["speed"]["head_seconds"] == 0.07
    _, _, kw = faked[0]
    assert kw["tokens"] == 800 and kw["threads"] == 1 and kw["reprobe"]


def test_nothing_within_the_limit_names_the_fastest_and_exits_1(faked, capsys):
    assert pick.run(parse("--max-seconds", "5")) == 1
    out = capsys.readouterr().out
    assert "Recommended: nothing fits" in out
    assert "No quant that fits answers within 5 s: the fastest, Q2_K, is predicted at 9.0 s" in out


def test_with_eval_the_time_limit_applies_to_the_quants_that_keep_the_answers():
    rec = recommend(BOX, "clef-flash")
    table = fake_table()
    choice = speed.choose(rec, table, max_seconds=15, prefer="quality", keeps={"Q8_0", "Q5_K_M", "Q4_K_M"})
    assert choice.quant == "Q4_K_M" and "smallest quant that fits and keeps" in choice.reason
    assert speed.choose(rec, table, max_seconds=None, prefer="speed", keeps={"Q8_0", "Q6_K"}).quant == "Q6_K"
    assert speed.choose(rec, table, max_seconds=1, prefer="quality", keeps={"Q8_0"}).quant is None
    with pytest.raises(InvalidValue) as err:
        speed.choose(rec, table, max_seconds=None, prefer="fast")
    assert err.value.field == "prefer"


def test_eval_and_max_seconds_together_on_the_command_line(faked, tmp_path, capsys):
    models = [{"label": q, "info": {"quant": q.lower(), "calibration_version": "none"},
               **({"agreement": {"overall": {"n": 400, "top1": t}}} if t is not None else {})}
              for q, t in (("Q8_0", None), ("Q6_K", 0.998), ("Q4_K_M", 0.995), ("Q2_K", 0.91))]
    (tmp_path / "summary.json").write_text(json.dumps({"models": models}))
    # Q4_K_M is the smallest that keeps >= 0.99, and it answers within 12 s: chosen.
    assert pick.run(parse("--eval", str(tmp_path), "--min-agreement", "0.99", "--max-seconds", "12")) == 0
    out = capsys.readouterr().out
    assert "Recommended: clef-flash:Q4_K_M" in out and "smallest quant that fits and keeps" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("Q2_K "))
    assert row.split()[-3:] == ["9.0", "56", "0.9100"]  # seconds, tok/s, agreement
    # Within 10 s only Q2_K answers, and it does not keep the answers: nothing is recommended.
    assert pick.run(parse("--eval", str(tmp_path), "--min-agreement", "0.99", "--max-seconds", "10")) == 1
    assert "No quant that fits and keeps your answers answers within 10 s" in capsys.readouterr().out


def test_no_probe_prints_memory_only_and_refuses_what_needs_the_probe(faked, capsys):
    assert pick.run(parse("--no-probe")) == 0
    out = capsys.readouterr().out
    assert "seconds" not in out and "Recommended: clef-flash:" in out and not faked
    for argv, field in ((["--no-probe", "--max-seconds", "3"], "no_probe"),
                        (["--no-probe", "--prefer", "speed"], "no_probe"),
                        (["--no-probe", "--reprobe"], "reprobe"),
                        (["--quants", "Q4_K_M,Q9_9"], "quants")):
        with pytest.raises(InvalidValue) as err:
            pick.run(parse(*argv))
        assert err.value.field == field, argv
    assert "Q9_9" in str(err.value)
    # --picture without the probe: the vision tower's memory only, in every quant's need and the reason
    assert pick.run(parse("--no-probe", "--json")) == 0
    text = json.loads(capsys.readouterr().out)
    assert pick.run(parse("--no-probe", "--picture", "448", "--json")) == 0
    pictures = json.loads(capsys.readouterr().out)
    vision = pictures["recommendation"]["breakdown"]["vision_tower"]
    assert vision > 0 and text["recommendation"]["breakdown"]["vision_tower"] == 0 and not faked
    assert [r["memory_bytes"] + vision for r in text["table"] if not r["by_name"]] == \
        [r["memory_bytes"] for r in pictures["table"] if not r["by_name"]]


@pytest.mark.parametrize("argv, words", [(["--max-seconds", "-1"], "must be >= 0 seconds"),
                                         (["--tokens", "0"], "must be"), (["--prefer", "fast"], "invalid choice"),
                                         (["--picture", "0"], "must be")])
def test_bad_flags_are_refused_by_the_parser(argv, words, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert words in capsys.readouterr().err


def test_a_family_without_confirmed_shapes_has_no_probe(monkeypatch, capsys):
    monkeypatch.setattr(pick, "probe", lambda **_: DeviceProfile(128 * GiB, 120 * GiB, 2, "x86_64", X86))
    assert speed.measure("clef", ["Q4_K_M"], threads=2) is None
    assert pick.run(parse("--family", "clef")) == 0
    assert "Speed: no probe for clef (its tower shapes are not confirmed); memory only." in capsys.readouterr().out
    with pytest.raises(InvalidValue) as err:
        pick.run(parse("--family", "clef", "--max-seconds", "30"))
    assert err.value.field == "family"


# ------------------------------------------------------------------------------------------ the prediction

def test_a_decision_decodes_its_state_and_its_rest_in_chunks_of_the_tower_batch():
    assert speed.DECODE_CHUNK == 512
    assert [speed.decode_calls(n) for n in (1, 2, 373, 1024, 1025, 2000)] == [1, 2, 2, 2, 3, 4]


def test_the_line_through_the_fastest_runs_of_two_lengths_predicts_calls_and_tokens():
    # 0.12 s per call and 0.004 s per token: 16 tokens 0.184 s, 64 tokens 0.376 s
    line = speed.tower_seconds(64, (0.376, 0.75), 16, (0.19, 0.184), 373)  # a slow run of each is not used
    assert line == pytest.approx(2 * 0.12 + 373 * 0.004)
    assert speed.tower_seconds(64, (0.376,), 16, (0.184,), 2000) == pytest.approx(4 * 0.12 + 2000 * 0.004)
    # no part per call (a type without fast kernels): the line through zero
    assert speed.tower_seconds(64, (0.64,), 16, (0.15,), 373) == pytest.approx(373 * 0.01)


def test_without_a_line_the_median_run_is_scaled():
    assert speed.tower_seconds(92, (0.3, 0.2, 0.25), None, (), 92) == pytest.approx(0.25)  # its own length
    assert speed.tower_seconds(16, (2.5,), None, (), 373) == pytest.approx(2.5 * 373 / 16)  # Q2_0's sizing run
    # a short end no faster than the long one (a busy machine) says nothing about a line
    assert speed.tower_seconds(64, (0.3, 0.4), 16, (0.31,), 373) == pytest.approx(0.35 * 373 / 64)


# ---------------------------------------------------------------------------------------------- the real probe

@pytest.fixture
def small_family(monkeypatch, tmp_path, machine_load):
    """The real probe at the ~110M preset's shapes (12 layers 3:1, probed whole) under clef-flash's name; its
    own cache; the machine quiet as the probe reads it (``machine_load``), whatever else runs."""
    monkeypatch.setattr(speed, "preset_for", {"clef-flash": "small"}.get)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(pick, "probe", lambda **_: BOX)


def test_the_real_probe_times_each_quant_and_keeps_the_result(small_family, capsys):
    assert pick.run(parse("--quants", "Q4_K_M,Q8_0,IQ2_XXS,Q6_K_L", "--tokens", "128", "--threads", "1",
                          "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    table = data["speed"]
    assert table["preset"] == "small" and table["layers"] == 12 and table["probe_layers"] == 12
    assert not table["cached"] and 0 < table["head_seconds"] < 5
    for quant in ("Q4_K_M", "Q8_0", "IQ2_XXS", "Q6_K_L"):
        row = table["quants"][quant]
        assert row["error"] is None, row
        # A cheap prefill (under speed_run.CHEAP_S, as these are) is timed at the decision's length
        # (128 tokens less the 36-token system prefix), three times: the median counts.
        assert row["probe_tokens"] == 92 and len(row["probe_runs"]) == 3
        assert row["seconds"] > row["tower_seconds"] > 0
        assert row["tower_seconds"] == pytest.approx(statistics.median(row["probe_runs"]), abs=1e-3)  # whole tower
    assert speed.cache_path().is_file()
    # The second pick reads the kept result: no process, same numbers, said so.
    assert pick.run(parse("--quants", "Q4_K_M,Q8_0", "--tokens", "128", "--threads", "1")) == 0
    out = capsys.readouterr().out
    assert "kept from" in out and "--reprobe measures again" in out
    again = speed.measure("clef-flash", ["Q8_0"], tokens=128, threads=1)
    assert again.cached and again.quants["Q8_0"].seconds == table["quants"]["Q8_0"]["seconds"]
    # Another token count or thread count is another measurement.
    assert speed.machine_key("small", 128, 1, {}) != speed.machine_key("small", 129, 1, {})
    assert speed.machine_key("small", 128, 1, {}) != speed.machine_key("small", 128, 2, {})


def test_a_long_decision_is_predicted_from_the_line_through_two_lengths(small_family):
    """8,000 tokens through the ~110M tower is not cheap (~11 s by the short end's estimate here, the cut
    1 s): the probe times 16 and 64 tokens, and the prediction is the line through the fastest of each."""
    table = speed.measure("clef-flash", ["Q4_K_M"], tokens=8000, threads=1)
    row = table.quants["Q4_K_M"]
    assert row.error is None and (row.probe_tokens, row.short_tokens) == (64, 16)
    assert len(row.probe_runs) == 2 and len(row.short_runs) == 2
    assert row.probe_seconds == pytest.approx(speed.tower_seconds(64, row.probe_runs, 16, row.short_runs, 8000 - 36),
                                              abs=1e-3)
    assert row.seconds == pytest.approx(row.tower_seconds + table.head_seconds, abs=1e-3)
    assert speed.cached(table.key).quants["Q4_K_M"] == dataclasses.replace(row)  # kept with both ends


def test_a_picture_adds_its_tokens_and_the_vision_towers_time(small_family, capsys):
    """--picture 64: resized up to Clef-Flash's 65,536-pixel minimum, 256 x 256, 16 x 16 patches merged
    2 x 2: 64 image tokens and the two markers."""
    assert pick.run(parse("--quants", "Q4_0", "--tokens", "128", "--threads", "2", "--picture", "64",
                          "--json")) == 0
    table = json.loads(capsys.readouterr().out)["speed"]
    assert (table["picture"], table["picture_tokens"]) == (64, 66) and table["picture_seconds"] > 0
    row = table["quants"]["Q4_0"]
    # the prediction is for the text past the system prefix and the picture, whichever lengths were timed
    decoded = 128 - 36 + 66
    assert row["probe_tokens"] <= decoded
    predicted = speed.tower_seconds(row["probe_tokens"], tuple(row["probe_runs"]), row["short_tokens"],
                                    tuple(row["short_runs"]), decoded)
    assert row["probe_seconds"] == pytest.approx(predicted, abs=1e-4)
    assert row["seconds"] == pytest.approx(row["tower_seconds"] + table["head_seconds"] + table["picture_seconds"],
                                           abs=1e-3)
    assert pick.run(parse("--quants", "Q4_0", "--tokens", "128", "--threads", "2", "--picture", "64")) == 0
    out = capsys.readouterr().out
    assert "Speed here: a decision of 128 text tokens and one 64x64 picture (66 more tokens" in out
    assert "kept from" in out  # the picture is part of the cache's key, and this one is kept
    assert speed.machine_key("small", 128, 1, {}, 64) != speed.machine_key("small", 128, 1, {}, None)


def test_the_nvfp4_ggufs_are_timed_when_named_and_never_chosen(small_family, capsys):
    """An NVFP4 checkpoint's GGUF is probed in its own types (NVFP4 projections with their second
    scales, ``probe_tower.nvfp4_retyped``) when --quants names it; it stays a by-name row."""
    assert pick.run(parse("--quants", "NVFP4A16-GGUF,NVFP4-GGUF,Q4_K_M", "--tokens", "128", "--threads", "1",
                          "--prefer", "speed", "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    for quant in ("NVFP4A16-GGUF", "NVFP4-GGUF"):
        row = data["speed"]["quants"][quant]
        assert row["error"] is None and row["seconds"] > row["tower_seconds"] > 0, row
    rows = {r["quant"]: r for r in data["table"]}
    assert rows["NVFP4A16-GGUF"]["by_name"] and not rows["Q4_K_M"]["by_name"]
    assert rows["NVFP4A16-GGUF"]["seconds"] == data["speed"]["quants"]["NVFP4A16-GGUF"]["seconds"]
    assert data["recommendation"]["quant"] == "Q4_K_M"  # the fastest of the candidates: never an NVFP4 GGUF
    assert pick.run(parse("--quants", "NVFP4A16-GGUF", "--tokens", "128", "--threads", "1")) == 0
    out = capsys.readouterr().out
    seconds = data["speed"]["quants"]["NVFP4A16-GGUF"]["seconds"]
    assert ("as an NVFP4 GGUF, clef-flash:nvfp4a16-gguf (llama.cpp, re-encoded on first use)" in out
            and f"predicted {seconds:.1f} s for a decision of 128 tokens" in out)
    assert "(pick --quants NVFP4-GGUF times it)" not in out  # kept from the first pick


def test_a_quant_the_build_cannot_make_is_that_rows_error_not_the_probes(small_family):
    table = speed.measure("clef-flash", ["Q4_0", "Q7_X"], tokens=64, threads=1)
    assert table.quants["Q4_0"].seconds > 0
    assert "Q7_X is not a type this llama.cpp build quantizes to" in table.quants["Q7_X"].error


def test_a_probe_process_that_fails_is_probe_failed_with_its_words(small_family, monkeypatch, capsys):
    from clef_gguf.pick import probe_process

    monkeypatch.setattr(probe_process, "module_command",
                        lambda module, *args: [sys.executable, "-c", "import sys; sys.exit('no GPU driver here')"])
    with pytest.raises(errors.ProbeFailed, match="no GPU driver here") as caught:
        speed.measure("clef-flash", ["Q4_K_M"], tokens=64, threads=1)
    assert caught.value.code == "probe_failed" and caught.value.exit_code == 1
    assert main(["pick", "--quants", "Q4_K_M", "--tokens", "64"]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "probe_failed"
