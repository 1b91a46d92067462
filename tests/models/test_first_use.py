"""A model converted on first use (``models.first_use``): made once under a lock, reused while its blob
is unchanged, made again when it changes; a killed conversion's stage is cleared; a failing or
blocked conversion is a clear error naming the model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock

from clef_gguf.core.errors import ConversionError, ModelLoadError
from clef_gguf.formats.files import MANIFEST
from clef_gguf.models import first_use


def _converter(model: Path, blob: Path, calls: list[Path]):
    """A conversion of ``blob``: the tiny model directory, its manifest naming ``blob`` as its source."""
    def convert(out: Path) -> None:
        calls.append(out)
        shutil.copytree(model, out)
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
        (out / MANIFEST).write_text(json.dumps({**manifest, "source": {"path": str(blob)}}), encoding="utf-8")
    return convert


def test_made_once_reused_and_made_again_when_the_blob_changes(tiny_model_dir, tmp_path):
    blob, out, calls = tmp_path / "blob.gguf", tmp_path / "cache" / "Q8_0", []
    blob.write_bytes(b"weights")
    convert = _converter(tiny_model_dir, blob, calls)
    made = first_use.converted_once(blob, out, convert, "the blob")
    assert made.tower.parent == out and first_use.conversion_is_current(out, blob)
    first_use.converted_once(blob, out, convert, "the blob")
    assert calls == [out]  # reused
    stale = out.parent / f".{out.name}.killed"  # a killed conversion's stage
    stale.mkdir()
    later = (out / MANIFEST).stat().st_mtime + 10
    os.utime(blob, (later, later))  # re-downloaded after the conversion
    assert not first_use.conversion_is_current(out, blob)
    first_use.converted_once(blob, out, convert, "the blob")
    assert calls == [out, out] and not stale.exists()
    assert not first_use.conversion_is_current(out, tmp_path / "another.gguf")


def test_a_failing_conversion_names_the_model_and_leaves_nothing(tmp_path):
    def fails(out: Path) -> None:
        raise ConversionError("no tensors")

    out = tmp_path / "cache" / "Q8_0"
    with pytest.raises(ConversionError, match="cannot split the native GGUF x: no tensors") as err:
        first_use.converted_once(tmp_path / "blob", out, fails, "the native GGUF x", verb="split")
    assert err.value.field == "model" and not out.exists()


def test_a_conversion_held_by_another_process_times_out_clearly(tmp_path, monkeypatch):
    out = tmp_path / "cache" / "Q8_0"
    out.parent.mkdir(parents=True)
    monkeypatch.setattr(first_use, "CONVERSION_LOCK_TIMEOUT_S", 0.2)
    with FileLock(str(out.parent / f".{out.name}.lock")):  # another process converting the same file
        with pytest.raises(ModelLoadError, match="stayed locked for 0.2 s") as err:
            first_use.converted_once(tmp_path / "blob", out, lambda _: None, "the blob")
    assert err.value.field == "model"
