"""The backend registry (``runtime/backends.py``'s ``BACKENDS``): every list of backend names derives
from it, and its rules (which backend the files ask for, which settings apply) hold for every row."""

from __future__ import annotations

from typing import get_args

import pytest

from clef_gguf.core import errors
from clef_gguf.formats.files import ModelFiles
from clef_gguf.runtime import backends
from clef_gguf.runtime.settings import LoadSettings


def test_load_settings_accept_exactly_the_registry_s_backends():
    # LoadSettings.backend's Literal is what --backend accepts (flags are generated from it): the
    # registry's names and "auto", nothing listed anywhere else
    assert get_args(LoadSettings.model_fields["backend"].annotation) == ("auto", *backends.BACKENDS)


def test_every_backend_has_a_distinct_runner_label_and_what_its_files_are():
    rows = backends.BACKENDS.values()
    assert len({b.runner for b in rows}) == len(backends.BACKENDS)
    assert all(b.files and b.label and callable(b.opener) for b in rows)


@pytest.mark.parametrize("asked", [None, "auto"])
def test_auto_is_what_the_files_are(asked, tmp_path):
    for name in backends.BACKENDS:
        found = ModelFiles(tmp_path / "t", tmp_path / "h", tmp_path / "c", tmp_path / "k", backend=name)
        assert backends.choose(asked, found) == name


def test_a_backend_the_files_are_not_is_refused_in_the_registry_s_words(tmp_path):
    found = ModelFiles(tmp_path / "t.gguf", tmp_path / "h", tmp_path / "c", tmp_path / "k", backend="gguf")
    with pytest.raises(errors.InvalidSetting, match="needs a compressed-tensors NVFP4 checkpoint") as err:
        backends.choose("nvfp4", found)
    assert err.value.field == "backend" and "a GGUF tower" in err.value.message
    with pytest.raises(errors.InvalidSetting, match="one of auto, gguf, nvfp4"):
        backends.choose("onnx", found)


def test_llama_settings_are_refused_for_a_tower_llama_cpp_does_not_run(fake_tower):
    backends.refuse_llama_settings(LoadSettings.of(model="m"), fake_tower)
    with pytest.raises(errors.InvalidSetting, match="--decode-chunk") as err:
        backends.refuse_llama_settings(LoadSettings.of(model="m", decode_chunk=256), fake_tower)
    assert err.value.field == "decode_chunk"
    assert set(backends.LLAMA_ONLY) <= set(LoadSettings.model_fields)
