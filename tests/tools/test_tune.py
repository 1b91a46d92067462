"""clef-gguf tune: the decision rule on a fake measurement (an injected timer and machine load), the
refusals, one real run end to end on the tiny model (kept, shown, and used by the next load), and one
under real load (nothing kept). Every test but the last reads the machine's load from ``machine_load``."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest

from clef_gguf import cli
from clef_gguf.core import load
from clef_gguf.core.errors import CacheNotWritable, InvalidSetting
from clef_gguf.core.limits import GPU_MAX_DP
from clef_gguf.models import tuned
from clef_gguf.runtime.model import Clef
from clef_gguf.tools import tune

LENGTHS = (466, 1986)
REAL_METER = load.Meter
pytestmark = pytest.mark.usefixtures("machine_load")


class FakeBench:
    """Seconds per decision from a table, answers from another: what a real bench measures, made up."""

    device = "cpu"

    def __init__(self, seconds, answers=None, values=None, skipped=None, tower=Path("fake.gguf")):
        self.seconds, self.dp = seconds, answers or {}
        self.values = values or {s: [v for (name, v) in seconds if name == s and v is not None]
                                 for s in dict.fromkeys(name for name, _ in seconds)}
        self.skipped, self.tower = skipped or {}, tower
        self.defaults = {"threads": 2, "decode_chunk": 512, "flash_attention": "auto", "pack_size": 4}
        self.calls = []

    def candidates(self):
        return self.values, self.skipped

    def use(self, setting, value):
        return nullcontext()

    def time(self, setting, value, length):
        self.calls.append((setting, value, length))
        return self.seconds[(setting, value)][length]

    def answers(self, setting, value, length):
        return np.full(4, 0.25) + self.dp.get((setting, value), 0.0)


def secs(short, long):
    return {466: short, 1986: long}


def test_a_value_wins_only_faster_by_more_than_5_percent_at_both_lengths_with_the_same_answers():
    bench = FakeBench({("decode_chunk", None): secs(1.0, 4.0), ("decode_chunk", 256): secs(0.90, 3.6),  # 11% both
                       ("decode_chunk", 1024): secs(1.0, 3.0),  # faster at 1,986 only
                       ("decode_chunk", 2048): secs(0.5, 2.0),  # fastest, but its answers move 2e-4
                       ("threads", None): secs(1.0, 4.0), ("threads", 1): secs(0.96, 3.84),  # 4%: noise
                       ("pack_size", None): secs(1.0, 4.0), ("pack_size", 8): secs(0.5, 2.0)},  # moves 1e-7
                      answers={("decode_chunk", 2048): 2e-4, ("pack_size", 8): 1e-7})
    result = tune.tune(bench, lengths=LENGTHS, rounds=3)
    assert result.chosen == {"decode_chunk": 256}
    trials = {(t.setting, t.value): t for t in result.trials}
    assert trials[("decode_chunk", 256)].won and trials[("decode_chunk", 256)].speedups == (1.1111, 1.1111)
    assert "not faster by more than 5% at every length" in trials[("decode_chunk", 1024)].reason
    wide = trials[("decode_chunk", 2048)]
    assert not wide.won and "answers differ by up to 0.0002" in wide.reason
    assert not trials[("threads", 1)].won
    # pack keeps the CPU's arithmetic: its bar is byte-identical, and 1e-7 fails it
    assert trials[("pack_size", 8)].bar == 0.0 and not trials[("pack_size", 8)].won
    assert trials[("decode_chunk", 256)].bar == GPU_MAX_DP
    assert result.lengths == LENGTHS and result.rounds == 3 and result.device == "cpu"


def test_of_several_winners_the_largest_smallest_gain_is_chosen_and_the_rounds_alternate():
    bench = FakeBench({("decode_chunk", None): secs(1.0, 4.0), ("decode_chunk", 256): secs(0.8, 2.0),
                       ("decode_chunk", 1024): secs(0.7, 3.0)})
    result = tune.tune(bench, only=("decode_chunk",), lengths=LENGTHS, rounds=2)
    assert result.chosen == {"decode_chunk": 1024}  # 1.33x/1.43x beats 1.25x/2x on its smaller gain
    timed = bench.calls[4:12]  # 256's trial after its warm-ups: 2 rounds x 2 lengths x 2 sides
    assert [v for _, v, n in timed if n == 466] == [None, 256, 256, None]  # A B, then B A


def test_the_spread_is_each_rounds_ratio():
    base = {466: [1.0, 1.2, 1.0], 1986: [4.0, 4.0, 4.4]}
    tried = {466: [0.8, 0.8, 1.0], 1986: [3.0, 4.0, 3.0]}
    trial = tune.judge("threads", 1, LENGTHS, base, tried, 0.0, 0.0)
    assert trial.spreads == ((1.0, 1.5), (1.0, 1.4667)) and trial.speedups == (1.25, 1.3333) and trial.won


def test_settings_not_measured_are_said_with_why():
    bench = FakeBench({("threads", None): secs(1, 1), ("threads", 1): secs(2, 2)},
                      skipped={"head_device": "no CUDA device: the head runs on the CPU", "flash_attention": "f32"})
    result = tune.tune(bench, only=("threads", "head_device"), lengths=LENGTHS, rounds=2)
    assert result.skipped == {"head_device": "no CUDA device: the head runs on the CPU"}
    assert result.chosen == {}


def test_an_unknown_setting_is_refused_naming_it(capsys, tiny_model_dir):
    with pytest.raises(InvalidSetting, match="'turbo'"):
        tune.check_names(["threads", "turbo"])
    assert tune.check_names(["pack_size", "threads"]) == ("threads", "pack_size")
    assert cli.main(["tune", "--model", str(tiny_model_dir), "--only", "threads,turbo"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "invalid_setting" and error["field"] == "only" and "turbo" in error["message"]


def test_a_model_that_does_not_load_is_a_clear_error(capsys, tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert cli.main(["tune", "--model", str(tmp_path / "nothing-here")]) == 1  # as decide says it
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "model_not_found"
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.is_file():
            (broken / path.name).write_bytes(path.read_bytes())
    tower = next(broken.glob("*.gguf"))
    tower.write_bytes(tower.read_bytes()[:4096])  # cut short
    assert cli.main(["tune", "--model", str(broken)]) != 0
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] in ("corrupt_model", "model_load_error") and tower.name in error["message"]
    assert not tuned.cache_path().exists()  # nothing kept


def test_bad_lengths_and_rounds_are_refused(capsys, tiny_model_dir):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["tune", "--model", str(tiny_model_dir), "--lengths", "466,abc"])
    assert exit_.value.code == 2 and "466,abc" in capsys.readouterr().err
    assert cli.main(["tune", "--model", str(tiny_model_dir), "--rounds", "1"]) == 2


def test_a_real_run_on_the_tiny_model_is_kept_shown_and_used(capsys, tmp_path, tiny_model_dir_factory, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    model = tiny_model_dir_factory("q8_0")
    assert cli.main(["tune", "--model", str(model), "--lengths", "40,80", "--rounds", "2",
                     "--only", "decode_chunk,flash_attention,head_device", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == "cpu" and result["lengths"] == [40, 80] and result["rounds"] == 2
    assert {t["setting"] for t in result["trials"]} == {"decode_chunk", "flash_attention"}
    assert {t["value"] for t in result["trials"] if t["setting"] == "decode_chunk"} == {256, 1024, 2048}
    for trial in result["trials"]:
        assert len(trial["speedups"]) == 2 and all(s > 0 for s in trial["speedups"])
        assert trial["max_dp"] <= 1e-2 and trial["bar"] == GPU_MAX_DP
        assert trial["won"] == (all(s > 1.05 for s in trial["speedups"]) and trial["max_dp"] <= 1e-4)
    assert "head_device" in result["skipped"] or "head_device" in {t["setting"] for t in result["trials"]}
    kept = tuned.current(next(model.glob("*.gguf")), "cpu")
    assert kept is not None and kept.chosen == result["chosen"]
    assert cli.main(["tune", "--model", str(model), "--show"]) == 0
    shown = capsys.readouterr().out
    assert "decode_chunk=256" in shown and ("chosen: " in shown) and "STALE" not in shown
    # the next load uses what was kept (here forced, so that the test does not hang on this machine's speed)
    tuned.store(tuned.Tuning(kept.model, "cpu", kept.machine, kept.defaults, {"decode_chunk": 256}))
    with Clef.load(model) as clef:
        assert clef.tower.n_batch == 256 and clef.info["tuned"] == {"decode_chunk": 256}
    with Clef.load(model, tune=False) as clef:
        assert clef.tower.n_batch == 512


def test_the_text_says_what_won_and_why(machine_load):
    from clef_gguf.tools.tune_command import describe

    bench = FakeBench({("decode_chunk", None): secs(1.0, 4.0), ("decode_chunk", 256): secs(0.8, 3.0)},
                      skipped={"head_device": "no CUDA device: the head runs on the CPU"})
    result = tune.tune(bench, lengths=LENGTHS, rounds=2)
    assert not result.loaded and not result.trials[0].loaded and result.trials[0].load["contended_cores"] == 0
    text = describe(result)
    assert "decode_chunk=256 (512 by default): WINS: faster at every length: 1.25x at 466, 1.33x at 1986" in text
    assert "head_device: not measured: no CUDA device" in text and "chosen: decode_chunk=256" in text
    assert "under load" not in text


def test_a_run_under_load_chooses_nothing_and_says_so(machine_load):
    """Other processes on the measured cores while a value is timed: the ratio measures them too. The run
    chooses nothing, its text says why, and the store refuses it."""
    from clef_gguf.tools.tune_command import describe

    machine_load.busy(1.7)
    bench = FakeBench({("threads", None): secs(1.0, 4.0), ("threads", 1): secs(0.4, 1.6)})  # 2.5x: load's artifact
    result = tune.tune(bench, lengths=LENGTHS, rounds=2)
    assert result.loaded and result.chosen == {}
    trial = result.trials[0]
    assert trial.won and trial.loaded and trial.load["contended_cores"] == 1.7
    text = describe(result)
    assert "threads=1 (2 by default): faster, but timed under load" in text and "held 1.70 of its cores" in text
    assert "chosen: nothing: other processes kept the measured cores busy" in text and "Nothing was kept" in text
    with pytest.raises(InvalidSetting, match="under load is not kept"):
        tuned.store(result)
    assert tuned.Tuning.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_a_home_that_cannot_be_written_is_an_error_not_a_claim(fake_tower, tmp_path, monkeypatch):
    home = tmp_path / "read-only"
    home.mkdir()
    (home / "clef-gguf").write_text("a file where the folder should be")
    monkeypatch.setenv("HF_HOME", str(home))
    result = tuned.Tuning(str(fake_tower), "cpu", tuned.machine_hash("cpu"), {"threads": 2}, {"threads": 1})
    with pytest.raises(CacheNotWritable) as caught:
        tuned.store(result)
    assert caught.value.field == "HF_HOME" and "nothing was kept" in caught.value.message
    assert caught.value.exit_code == 1


def test_a_value_that_cannot_run_is_reported_and_the_run_goes_on():
    class Refusing(FakeBench):
        def use(self, setting, value):
            if value == "on":
                raise InvalidSetting("flash attention is not supported here", field="flash_attention")
            return nullcontext()

    bench = Refusing({("flash_attention", None): secs(1.0, 4.0), ("flash_attention", "on"): secs(0.5, 2.0),
                      ("flash_attention", "off"): secs(0.5, 2.0)})
    result = tune.tune(bench, lengths=LENGTHS, rounds=2)
    failed = next(t for t in result.trials if t.value == "on")
    assert not failed.won and failed.max_dp is None
    assert "could not run: flash attention is not supported" in failed.reason
    assert result.chosen == {"flash_attention": "off"}
    assert tuned.Tuning.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_a_value_whose_load_fails_with_any_error_is_recorded_and_the_rest_kept():
    """Not only a ClefError: a load that fails otherwise (a backend's RuntimeError) is that value's finding."""
    class Failing(FakeBench):
        def use(self, setting, value):
            if value == 256:
                raise RuntimeError("ggml_backend_alloc failed")
            return nullcontext()

    bench = Failing({("decode_chunk", None): secs(1.0, 4.0), ("decode_chunk", 256): secs(0.5, 2.0),
                     ("decode_chunk", 1024): secs(0.5, 2.0)})
    result = tune.tune(bench, lengths=LENGTHS, rounds=2)
    failed = next(t for t in result.trials if t.value == 256)
    assert not failed.won and failed.reason == "could not run: RuntimeError: ggml_backend_alloc failed"
    assert result.chosen == {"decode_chunk": 1024}


def test_model_bench_closes_its_model_when_setting_up_fails(tiny_model_dir, monkeypatch):
    from clef_gguf.tools import workload

    closed = []
    real_close = Clef.close
    monkeypatch.setattr(Clef, "close", lambda self: (closed.append(self), real_close(self))[1])

    def boom(clef, n):
        raise RuntimeError("no request of that size")

    monkeypatch.setattr(workload, "sized_request", boom)
    with pytest.raises(RuntimeError, match="no request of that size"):
        tune.ModelBench({"model": str(tiny_model_dir), "gpu_layers": 0}, (64,))
    assert len(closed) == 1


def test_an_nvfp4_checkpoint_is_refused_and_its_loads_refuse_llama_settings(capsys, tiny_nvfp4_dir):
    model = tiny_nvfp4_dir("nvfp4a16")
    assert cli.main(["tune", "--model", str(model), "--only", "threads"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["field"] == "model" and "tune measures llama.cpp towers" in error["message"]
    with pytest.raises(InvalidSetting, match="--pack-size"):
        Clef.load(model, pack_size=2)


@pytest.mark.live_machine
def test_tune_under_real_load_keeps_nothing_under_any_load(capsys, tmp_path, tiny_model_dir_factory, monkeypatch):
    """A process spinning on every core through a real run: tune says the run was under load, chooses
    nothing and keeps nothing; the defaults stay in force. (More load only makes it more so.)"""
    import subprocess
    import sys

    import psutil

    monkeypatch.setattr(load, "Meter", REAL_METER)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    model = tiny_model_dir_factory("q8_0")
    spin = "import time\nt = time.time()\nwhile time.time() - t < 120: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(psutil.cpu_count() or 1)]
    try:
        code = cli.main(["tune", "--model", str(model), "--lengths", "40", "--rounds", "2", "--only", "decode_chunk"])
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    out = capsys.readouterr().out
    assert code == 0 and "chosen: nothing: other processes kept the measured cores busy" in out
    assert not tuned.cache_path().exists()
    with Clef.load(model) as clef:
        assert clef.info["tuned"] == {} and clef.tower.n_batch == 512
