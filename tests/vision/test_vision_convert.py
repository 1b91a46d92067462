"""`convert` writes the release's vision tower (vision.safetensors + vision_config.json, hashed in the
manifest); the tower loaded from the converted directory is the release's; broken vision files are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from clef_gguf.formats import files
from clef_gguf.convert.release import convert_release
from clef_gguf.core.errors import ConversionError, CorruptModel, ModelNotFound
from clef_gguf.vision import VISION_CONFIG, VISION_WEIGHTS, VisionTower


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(path, change):
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def rewrite_json(path, change):
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


def test_convert_writes_the_vision_files(tiny_release, tiny_model_dir):
    manifest = files.read_manifest(tiny_model_dir)
    assert manifest["vision"] == {"weights": VISION_WEIGHTS, "config": VISION_CONFIG}
    for name in (VISION_WEIGHTS, VISION_CONFIG):
        path = tiny_model_dir / name
        assert manifest["files"][name] == {"sha256": files.sha256_file(path), "size": path.stat().st_size}
    release_config = json.loads((tiny_release / "config.json").read_text())["vision_config"]
    assert json.loads((tiny_model_dir / VISION_CONFIG).read_text()) == release_config
    stored = load_file(str(tiny_release / "model.safetensors"))
    written = load_file(str(tiny_model_dir / VISION_WEIGHTS))
    assert set(written) == {name.removeprefix("model.visual.") for name in stored if name.startswith("model.visual.")}
    for name, tensor in written.items():  # as stored: same dtype, same shape, same bits
        assert tensor.dtype == stored["model.visual." + name].dtype
        assert torch.equal(tensor, stored["model.visual." + name]), name
    files.from_directory(tiny_model_dir)  # the model directory still loads as before


def test_the_converted_tower_is_the_release_tower(tiny_release, tiny_model_dir):
    converted, release = VisionTower.load(tiny_model_dir), VisionTower.load(tiny_release)
    for (name, a), (_, b) in zip(converted.model.state_dict().items(), release.model.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    grid = torch.tensor([[1, 4, 6]])
    pixel_values = torch.randn(24, converted.config.patch_dim, generator=torch.Generator().manual_seed(3))
    assert torch.equal(converted.embed(pixel_values, grid), release.embed(pixel_values, grid))
    explicit = VisionTower.load((tiny_model_dir / VISION_CONFIG, tiny_model_dir / VISION_WEIGHTS))
    assert torch.equal(explicit.embed(pixel_values, grid), release.embed(pixel_values, grid))


def test_a_text_only_release_converts_without_a_vision_part(tiny_release, tmp_path):
    src = copy_dir(tiny_release, tmp_path / "text-only")
    rewrite_weights(src / "model.safetensors",
                    lambda t: [t.pop(name) for name in list(t) if name.startswith("model.visual.")])
    rewrite_json(src / "config.json", lambda c: c.pop("vision_config"))
    out = convert_release(src, tmp_path / "out", outtype="f32")
    manifest = files.read_manifest(out)
    assert "vision" not in manifest and VISION_WEIGHTS not in manifest["files"]
    assert not (out / VISION_WEIGHTS).exists()
    with pytest.raises(ModelNotFound) as caught:
        VisionTower.load(src)
    assert caught.value.field == "vision"


def test_a_release_with_a_broken_vision_tower_does_not_convert(tiny_release, tmp_path):
    src = copy_dir(tiny_release, tmp_path / "broken")
    rewrite_weights(src / "model.safetensors", lambda t: t.pop("model.visual.merger.linear_fc2.bias"))
    with pytest.raises(ConversionError) as caught:
        convert_release(src, tmp_path / "out", outtype="f32")
    assert caught.value.field == "vision"
    assert "merger.linear_fc2.bias" in caught.value.message
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ broken converted files

def _truncate(directory):
    path = directory / VISION_WEIGHTS
    path.write_bytes(path.read_bytes()[:-100])


def _garbage_header(directory):
    path = directory / VISION_WEIGHTS
    data = bytearray(path.read_bytes())
    data[8:40] = b"x" * 32
    path.write_bytes(bytes(data))


def _nan(directory):
    def change(t):
        t["blocks.0.attn.qkv.weight"][0, 0] = float("nan")
    rewrite_weights(directory / VISION_WEIGHTS, change)


def _wrong_shape(directory):
    def change(t):
        t["pos_embed.weight"] = t["pos_embed.weight"][:9].clone()
    rewrite_weights(directory / VISION_WEIGHTS, change)


def _extra_tensor(directory):
    def change(t):
        t["blocks.1.norm1.weight"] = t["blocks.0.norm1.weight"].clone()
    rewrite_weights(directory / VISION_WEIGHTS, change)


def _integer_tensor(directory):
    def change(t):
        t["merger.norm.bias"] = t["merger.norm.bias"].to(torch.int32)
    rewrite_weights(directory / VISION_WEIGHTS, change)


def _config_not_json(directory):
    (directory / VISION_CONFIG).write_bytes(b"{not json\xff")


def _config_not_an_object(directory):
    (directory / VISION_CONFIG).write_text("[1, 2]")


def _config_other_size(directory):
    rewrite_json(directory / VISION_CONFIG, lambda c: c.update(hidden_size=48))


def _config_bad_value(directory):
    rewrite_json(directory / VISION_CONFIG, lambda c: c.update(depth="one"))


def _config_other_activation(directory):
    rewrite_json(directory / VISION_CONFIG, lambda c: c.update(hidden_act="relu6"))


def _config_not_square(directory):
    rewrite_json(directory / VISION_CONFIG, lambda c: c.update(num_position_embeddings=15))


CORRUPT = [_truncate, _garbage_header, _nan, _wrong_shape, _extra_tensor, _integer_tensor, _config_not_json,
           _config_not_an_object, _config_other_size, _config_bad_value, _config_other_activation,
           _config_not_square]


@pytest.mark.parametrize("damage", CORRUPT, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_vision_files_are_refused(tiny_model_dir, tmp_path, damage):
    directory = copy_dir(tiny_model_dir, tmp_path / "model")
    damage(directory)
    with pytest.raises(CorruptModel) as caught:
        VisionTower.load(directory)
    assert caught.value.field == "vision"


@pytest.mark.parametrize("missing", [VISION_WEIGHTS, VISION_CONFIG])
def test_missing_vision_files_are_refused(tiny_model_dir, tmp_path, missing):
    directory = copy_dir(tiny_model_dir, tmp_path / "model")
    (directory / missing).unlink()
    with pytest.raises(ModelNotFound) as caught:
        VisionTower.load(directory)
    assert caught.value.field == "vision"


def test_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(ModelNotFound) as caught:
        VisionTower.load(tmp_path / "nowhere")
    assert caught.value.field == "vision"


def test_a_release_missing_a_listed_shard_is_refused(tmp_path):
    from clef_gguf.convert.synthetic.tiny import build_release

    src = build_release(tmp_path / "sharded", preset="tiny", seed=0, shards=3)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    (src / index["weight_map"]["model.visual.pos_embed.weight"]).unlink()
    with pytest.raises(ModelNotFound) as caught:
        VisionTower.load(src)
    assert caught.value.field == "vision"
