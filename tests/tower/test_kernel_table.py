"""The kernel table: a setting replaces the default only where it was measured faster by more than the
noise at every length, and a tower loads with what the table chose (defaults while it is empty)."""

from __future__ import annotations

import numpy as np

from clef_gguf.formats.files import from_directory
from clef_gguf.tower import kernel_table as kt
from clef_gguf.tower.llama_tower import Tower


def rows(weights, device, attention, n_batch, ms466, ms1986):
    return [kt.Measured(weights, device, attention, n_batch, 466, ms466),
            kt.Measured(weights, device, attention, n_batch, 1986, ms1986)]


# Made-up numbers in the shape the GPU check records them (scripts/gpu_rows.py kernels)
RECORDED = [*rows("Q4_K_M", "gpu", "default", 512, 16.6, 60.6), *rows("Q4_K_M", "gpu", "flash-on", 512, 15.0, 52.0),
            *rows("Q4_K_M", "gpu", "default", 2048, 16.4, 45.0),  # wins at 1,986 only: not everywhere
            *rows("bf16", "gpu", "default", 512, 9.0, 30.0), *rows("bf16", "gpu", "flash-off", 512, 8.8, 29.5),
            *rows("q8_0", "gpu", "flash-on", 512, 5.0, 20.0)]  # no default measured: no choice


def test_the_fastest_setting_wins_only_by_more_than_the_noise_everywhere():
    chosen = kt.choose(RECORDED)
    assert chosen[("q4_k_m", "gpu")] == kt.Choice("flash-on", 512, round(16.6 / 15.0 - 1, 3))
    assert chosen[("bf16", "gpu")] == kt.Choice("default", 512, 0.0)  # 2% faster is noise
    assert ("q8_0", "gpu") not in chosen
    assert kt.setting_for("Q4_K_M", "gpu", RECORDED).attention == "flash-on"
    assert kt.setting_for("q4_k_m", "cpu", RECORDED) == kt.Choice(*kt.DEFAULT, 0.0)
    assert kt.MEASURED == () and kt.setting_for("q4_k_m", "gpu") == kt.Choice("default", 512, 0.0)


def test_a_tower_loads_with_what_the_table_chose(tiny_model_dir_factory, monkeypatch):
    tower_file = from_directory(tiny_model_dir_factory("q8_0")).tower
    with Tower.load(tower_file) as tower:  # an empty table: the defaults
        assert (tower.details()["attention"], tower.n_batch) == ("default", 512)
        before = tower.hidden_states(np.arange(300, 340, dtype=np.int32))
    monkeypatch.setattr(kt, "MEASURED", tuple(rows("q8_0", "cpu", "default", 512, 10, 40)
                                               + rows("q8_0", "cpu", "flash-off", 256, 8, 30)))
    with Tower.load(tower_file) as tower:
        assert (tower.details()["attention"], tower.n_batch) == ("flash-off", 256)
        after = tower.hidden_states(np.arange(300, 340, dtype=np.int32))
    assert np.abs(before - after).max() < 0.05 * np.abs(before).max()  # other kernels and chunks, the same model
