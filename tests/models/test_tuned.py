"""The kept tunings: one entry per tower file and device, used only on the machine and llama.cpp build
that measured it (another CPU, core count, llama.cpp version or GPU makes it stale)."""

from __future__ import annotations

import pytest

from clef_gguf.models import machine, tuned


def tuning(tower, device="cpu", chosen=None, gpus=()):
    return tuned.Tuning(str(tower.resolve()), device, tuned.machine_hash(device, gpus), {"decode_chunk": 512},
                        chosen if chosen is not None else {"decode_chunk": 256}, lengths=(40, 80), rounds=2,
                        measured_at=tuned.now())


@pytest.fixture
def tower(fake_tower):
    return fake_tower


def test_a_tuning_is_kept_per_tower_and_device_and_read_back(tower):
    assert tuned.kept(tower, "cpu") is None and tuned.current(tower, "cpu") is None
    tuned.store(tuning(tower))
    got = tuned.current(tower, "cpu")
    assert got.chosen == {"decode_chunk": 256} and got.lengths == (40, 80)
    assert tuned.Tuning.from_dict(got.to_dict()) == got
    assert tuned.current(tower, "gpu") is None  # the other device has its own entry
    tuned.store(tuning(tower, chosen={}))  # measured again: replaces the entry
    assert tuned.current(tower, "cpu").chosen == {}
    assert tuned.cache_path().parent == tower.parent / "hf" / "clef-gguf"  # beside pick's speed table


@pytest.mark.parametrize("change", [{"llama_cpp": "0.0.0-other"}, {"system_info": "CPU : AVX2 = 0 |"},
                                    {"cpu": "Another CPU"}, {"cores": 128}])
def test_a_tuning_from_another_machine_or_llama_cpp_build_is_stale(tower, monkeypatch, change):
    tuned.store(tuning(tower))
    real = machine.fingerprint()
    monkeypatch.setattr(machine, "fingerprint", lambda: real | change)
    assert tuned.kept(tower, "cpu") is not None  # still there, for --show
    assert tuned.current(tower, "cpu") is None  # but not used


def test_a_gpu_tuning_is_stale_on_another_gpu(tower, monkeypatch):
    monkeypatch.setattr(tuned, "gpu_names", lambda: ("NVIDIA H200",))
    tuned.store(tuning(tower, "gpu", gpus=("NVIDIA H200",)))
    assert tuned.current(tower, "gpu") is not None
    monkeypatch.setattr(tuned, "gpu_names", lambda: ("NVIDIA L4",))
    assert tuned.current(tower, "gpu") is None


def test_a_changed_tower_file_or_an_unreadable_cache_has_no_tuning(tower):
    tuned.store(tuning(tower))
    tower.write_bytes(b"GGUF" + bytes(100))  # another file at the same path
    assert tuned.kept(tower, "cpu") is None
    tuned.cache_path().write_text("{not json")
    assert tuned.kept(tower, "cpu") is None
    tuned.store(tuning(tower))  # a damaged file is replaced
    assert tuned.current(tower, "cpu") is not None
