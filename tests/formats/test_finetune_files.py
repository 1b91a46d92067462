"""The fine-tune directory's manifest (``clef_gguf.formats.finetune_files``): read, checked, refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_gguf.core.errors import CorruptModel, ModelNotFound
from clef_gguf.formats.finetune_files import ADAPTER_MANIFEST, AdapterFiles, read_adapter_manifest

SHA = "ab" * 32


def _write(directory: Path, **changes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("adapter-f16.gguf", "joint_head.safetensors", "joint_head_config.json"):
        (directory / name).write_bytes(b"x")
    manifest = {
        "format": "clef-gguf-adapter/1", "name": "ft", "adapter": "adapter-f16.gguf",
        "head_weights": "joint_head.safetensors", "head_config": "joint_head_config.json",
        "base": {"name": "base", "tower": "tower-f32.gguf", "tower_sha256": SHA, "architecture": "qwen35",
                 "n_embd": 64, "n_layer": 4, "n_vocab": 640},
        "lora": {"rank": 8, "alpha": 16.0, "targets": 31, "outtype": "f16"},
        "source": {"checkpoint": "/c", "tool": "peft", "base_model": None, "train_config": None},
        "files": {name: {"sha256": SHA, "size": 1}
                  for name in ("adapter-f16.gguf", "joint_head.safetensors", "joint_head_config.json")},
    }
    for key, value in changes.items():
        if value is None:
            manifest.pop(key)
        else:
            manifest[key] = value
    (directory / ADAPTER_MANIFEST).write_text(json.dumps(manifest))
    return directory


def test_reads_a_fine_tune_directory(tmp_path):
    found = AdapterFiles.from_directory(_write(tmp_path / "ft"))
    assert found.name == "ft" and found.adapter == tmp_path / "ft" / "adapter-f16.gguf"
    assert found.head_weights.name == "joint_head.safetensors" and found.head_config.name == "joint_head_config.json"
    assert found.base["n_embd"] == 64 and found.lora["alpha"] == 16.0 and found.source["tool"] == "peft"
    assert found.sha256 == {"adapter-f16.gguf": SHA, "joint_head.safetensors": SHA, "joint_head_config.json": SHA}


@pytest.mark.parametrize("changes, match", [
    ({"format": "clef-gguf/1"}, "not a clef-gguf-adapter/1 manifest"),
    ({"adapter": None}, "does not name the adapter"),
    ({"adapter": "../adapter-f16.gguf"}, "outside its directory"),
    ({"files": {"adapter-f16.gguf": {"sha256": "no", "size": 1}}}, '"files" table'),
    ({"files": {"adapter-f16.gguf": {"sha256": SHA, "size": 1}}}, "lists no sha256 for joint_head"),
    ({"base": {"name": "b"}}, '"base"'),
    ({"lora": {"rank": True, "alpha": 1.0, "targets": 1, "outtype": "f16"}}, '"lora"'),
    ({"name": 3}, "name that is not text"),
    ({"source": []}, '"source"'),
])
def test_malformed_manifests_are_corrupt(tmp_path, changes, match):
    directory = _write(tmp_path / "ft", **changes)
    with pytest.raises(CorruptModel, match=match) as info:
        read_adapter_manifest(directory)
    assert info.value.field == "adapter"


def test_missing_pieces_are_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="fine-tune directory not found"):
        read_adapter_manifest(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="convert adapter"):
        read_adapter_manifest(tmp_path / "empty")
    directory = _write(tmp_path / "ft")
    (directory / "adapter-f16.gguf").unlink()
    with pytest.raises(ModelNotFound, match="adapter file not found") as info:
        AdapterFiles.from_directory(directory)
    assert info.value.field == "adapter"
    (directory / ADAPTER_MANIFEST).write_text("{")
    with pytest.raises(CorruptModel, match="not valid JSON"):
        read_adapter_manifest(directory)
