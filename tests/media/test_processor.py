"""clef_gguf.media's pixels, grids and expanded prompt against transformers' Qwen3VLProcessor.

The reference runs in a child process with ``tv_shim`` standing in for torchvision (see its docstring):
the test environment's torch has no importable torchvision, and every Qwen3-VL video processor and the
default (fast) image processor need one.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from media_helpers import IMAGE, VIDEO, data_uri, exif_rotated_jpeg, png_uri, run_reference
from tokenizers import Tokenizer

from clef_gguf.core import errors
from clef_gguf.convert.synthetic.tiny import TINY_IMAGE_PROCESSOR, TINY_VIDEO_PROCESSOR
from clef_gguf.media import (INLINE_ONLY, load_images, load_processor_config, load_video_frames, parse_media_kwargs,
                             prepare_media)
from clef_gguf.media.processor import resize, smart_resize

FRAMES = [png_uri(16, 24, seed) for seed in range(4)]
JPEG = data_uri(exif_rotated_jpeg(40, 24), "image/jpeg")
CASES = {
    "one image, no resize": dict(images=[png_uri(16, 24)]),
    "rounds and resizes": dict(images=[png_uri(20, 30, 1)]),
    "over the max, shrinks": dict(images=[png_uri(100, 100, 2)]),
    "under the min, grows": dict(images=[png_uri(9, 13, 3)]),
    "wide": dict(images=[png_uri(64, 8, 4)]),
    "two images": dict(images=[png_uri(40, 56, 5), png_uri(24, 24, 6)]),
    "two of one size": dict(images=[png_uri(33, 17, 7), png_uri(33, 17, 8)]),
    "rgba": dict(images=[png_uri(30, 20, 9, "RGBA")]),
    "exif rotated jpeg": dict(images=[JPEG]),
    "video of 4 frames": dict(videos=[FRAMES], kwargs={"do_sample_frames": False}),
    "video of 3 frames": dict(videos=[FRAMES[:3]], kwargs={"do_sample_frames": False}),
    "video that resizes": dict(videos=[[png_uri(50, 70, s) for s in range(4)]], kwargs={"do_sample_frames": False}),
    "image and video": dict(images=[png_uri(20, 30)], videos=[FRAMES], kwargs={"do_sample_frames": False}),
    "size": dict(images=[png_uri(40, 56)], videos=[FRAMES],
                 kwargs={"do_sample_frames": False, "size": {"shortest_edge": 64, "longest_edge": 1024}}),
    "min and max pixels": dict(images=[png_uri(40, 56)], kwargs={"min_pixels": 64, "max_pixels": 1024}),
    "fps with frames": dict(videos=[FRAMES], kwargs={"do_sample_frames": False, "fps": 2}),
}


# Clef-Flash's own processor settings (Qwen3.5: patch 16, merge 2 -> 32x32 pixels per token).
QWEN35_IMAGE = {**TINY_IMAGE_PROCESSOR, "patch_size": 16, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
QWEN35_VIDEO = {**TINY_VIDEO_PROCESSOR, "patch_size": 16, "size": {"shortest_edge": 4096, "longest_edge": 25165824}}
QWEN35_CASES = {
    "448x448": dict(images=[png_uri(448, 448, 11)]),
    "photo-sized, resizes": dict(images=[png_uri(701, 467, 12), data_uri(exif_rotated_jpeg(300, 200), "image/jpeg")]),
    "video": dict(videos=[[png_uri(160, 90, s) for s in range(4)]], kwargs={"do_sample_frames": False}),
}


@pytest.fixture(scope="module")
def release(tiny_release):
    return tiny_release


@pytest.fixture(scope="module")
def qwen35_release(tiny_release, tmp_path_factory):
    """The tiny release with Clef-Flash's processor files (the processor never reads the weights)."""
    out = tmp_path_factory.mktemp("qwen35")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_release / name, out / name)
    (out / "preprocessor_config.json").write_text(json.dumps(QWEN35_IMAGE))
    (out / "video_preprocessor_config.json").write_text(json.dumps(QWEN35_VIDEO))
    return out


def _reference_cases(cases):
    out = []
    for case in cases.values():
        text = IMAGE * len(case.get("images", [])) + VIDEO * len(case.get("videos", [])) + "\n"
        videos = [[frames] for frames in case["videos"]] if "videos" in case else None  # the reference's nesting
        out.append({"text": text, "images": case.get("images"), "videos": videos, "kwargs": case.get("kwargs", {})})
    return out


@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory):
    return tmp_path_factory.mktemp("saved")


@pytest.fixture(scope="module")
def reference(release, saved_by_transformers, tmp_path_factory):
    results = run_reference(release, _reference_cases(CASES), tmp_path_factory.mktemp("reference"),
                            save_to=saved_by_transformers)
    return dict(zip(CASES, results))


@pytest.fixture(scope="module")
def qwen35_reference(qwen35_release, tmp_path_factory):
    results = run_reference(qwen35_release, _reference_cases(QWEN35_CASES), tmp_path_factory.mktemp("reference35"))
    return dict(zip(QWEN35_CASES, results))


def _ours(release, case):
    config = load_processor_config(release)
    options, warnings = parse_media_kwargs(case.get("kwargs"))
    assert warnings == []
    images = load_images(case.get("images", []), INLINE_ONLY)
    videos = [load_video_frames(frames, INLINE_ONLY, f"videos.{v}") for v, frames in enumerate(case.get("videos", []))]
    return prepare_media(images, videos, config, options)


def _assert_equal(release, case, ref):
    assert "error" not in ref, ref.get("error")
    ours = _ours(release, case)
    for key, batch in (("pixel_values", ours.images), ("pixel_values_videos", ours.videos)):
        if key in ref:
            assert batch is not None and batch.pixel_values.dtype == torch.float32
            assert batch.pixel_values.shape == ref[key].shape
            assert (batch.pixel_values - ref[key]).abs().max().item() <= 1e-6, key
        else:
            assert batch is None
    if "image_grid_thw" in ref:
        assert torch.equal(ours.images.grid_thw, ref["image_grid_thw"])
        merge = load_processor_config(release).image.merge_size ** 2
        assert list(ours.image_tokens) == [int(g.prod()) // merge for g in ref["image_grid_thw"]]
    if "video_grid_thw" in ref:
        assert torch.equal(ours.videos.grid_thw, ref["video_grid_thw"])
    tokenizer = Tokenizer.from_file(str(release / "tokenizer.json"))
    ids = tokenizer.encode(ours.text, add_special_tokens=False).ids
    assert ids == ref["input_ids"][0].tolist()
    piecewise = []
    for text, count in ours.pieces:
        piecewise += tokenizer.encode(text, add_special_tokens=False).ids * count
    assert piecewise == ids


@pytest.mark.parametrize("name", list(CASES))
def test_equal_to_the_reference(release, reference, name):
    _assert_equal(release, CASES[name], reference[name])


@pytest.mark.parametrize("name", list(QWEN35_CASES))
def test_equal_to_the_reference_at_clef_flash_settings(qwen35_release, qwen35_reference, name):
    _assert_equal(qwen35_release, QWEN35_CASES[name], qwen35_reference[name])


@pytest.mark.skipif(not os.environ.get("CLEF_REAL_TORCHVISION"),
                    reason="set CLEF_REAL_TORCHVISION to an unpacked torchvision wheel (unzip torchvision-*.whl)")
def test_equal_to_real_torchvision_transforms(release, qwen35_release, tmp_path):
    """The shim's resize and normalize are torchvision's: run the real ones (decoding stays Pillow's)."""
    real = os.environ["CLEF_REAL_TORCHVISION"]
    for rel, cases in ((release, CASES), (qwen35_release, QWEN35_CASES)):
        results = run_reference(rel, _reference_cases(cases), tmp_path, real_torchvision=real)
        for (name, case), ref in zip(cases.items(), results):
            _assert_equal(rel, case, ref)
            ours = _ours(rel, case)
            for key, batch in (("pixel_values", ours.images), ("pixel_values_videos", ours.videos)):
                if key in ref:
                    assert torch.equal(batch.pixel_values, ref[key]), (name, key)


def test_reads_what_transformers_saves(release, reference, saved_by_transformers):
    assert (saved_by_transformers / "processor_config.json").is_file()
    assert not (saved_by_transformers / "preprocessor_config.json").exists()
    assert load_processor_config(saved_by_transformers) == load_processor_config(release)


def test_pixels_are_bit_identical(release, reference):
    """Same torch calls in the same order: not just close, equal."""
    ours = _ours(release, CASES["over the max, shrinks"])
    assert torch.equal(ours.images.pixel_values, reference["over the max, shrinks"]["pixel_values"])


def test_video_timestamps_and_doubled_markers(release):
    text = _ours(release, CASES["video of 4 frames"]).text
    assert text.startswith("<|vision_start|><0.0 seconds><|vision_start|><|video_pad|>")
    assert "<|vision_end|><0.1 seconds><|vision_start|>" in text
    assert text.endswith("<|vision_end|><|vision_end|>\n")


def test_the_reference_refusals_match(release, tmp_path):
    """Frames without do_sample_frames=false, a one-frame video: refused by both."""
    config = load_processor_config(release)
    frames = load_video_frames(FRAMES, INLINE_ONLY, "videos.0")
    options, _ = parse_media_kwargs({})
    with pytest.raises(errors.InvalidMedia) as caught:
        prepare_media([], [frames], config, options, video_fields=["videos.0"])
    assert caught.value.field == "videos.0"
    options, _ = parse_media_kwargs({"do_sample_frames": False})
    with pytest.raises(errors.InvalidMedia, match="at least 2 frames"):
        prepare_media([], [frames[:1]], config, options)
    refused = run_reference(release, [
        {"text": VIDEO + "\n", "videos": [[FRAMES]], "kwargs": {}},
        {"text": VIDEO + "\n", "videos": [[FRAMES[:1]]], "kwargs": {"do_sample_frames": False}}], tmp_path)
    assert "do_sample_frames" in refused[0]["error"] and "temporal_factor" in refused[1]["error"]


def test_aspect_ratio_over_200_is_invalid(release):
    with pytest.raises(errors.InvalidMedia) as caught:
        smart_resize(2, 401, 8, 64, 4096, field="images.3")
    assert caught.value.field == "images.3" and caught.value.code == "invalid_media"


def test_resize_is_torch_bicubic_antialias_on_uint8():
    """torchvision's CPU resize_image keeps uint8 for bicubic and calls torch's kernel with antialias."""
    pixels = torch.randint(0, 256, (2, 3, 37, 53), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.interpolate(pixels, size=[24, 32], mode="bicubic", align_corners=False,
                                               antialias=True)
    assert expected.dtype == torch.uint8
    assert torch.equal(resize(pixels, 24, 32, "bicubic"), expected)
    assert resize(pixels, 37, 53, "bicubic") is pixels


def test_media_kwargs():
    options, warnings = parse_media_kwargs({"size": {"shortest_edge": 64, "longest_edge": 1024}, "fps": 2,
                                            "do_sample_frames": False, "max_pixels": 512, "crop": True})
    assert options.size == (64, 1024) and options.max_pixels == 512 and options.fps == 2.0
    assert warnings == ["media_kwargs.crop is ignored"]
    for bad, field in (({"size": {"longest_edge": 5}}, "media_kwargs.size"),
                       ({"size": {"shortest_edge": 0, "longest_edge": 5}}, "media_kwargs.size.shortest_edge"),
                       ({"do_sample_frames": "no"}, "media_kwargs.do_sample_frames"),
                       ({"fps": -1}, "media_kwargs.fps")):
        with pytest.raises(errors.InvalidValue) as caught:
            parse_media_kwargs(bad)
        assert caught.value.field == field


def test_both_file_layouts(release, tmp_path):
    split = load_processor_config(release)
    assert split.image.factor == 8 and split.image.longest_edge == 64 * 64
    assert split.video.shortest_edge == TINY_VIDEO_PROCESSOR["size"]["shortest_edge"]
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "processor_config.json").write_text(json.dumps({
        "image_processor": TINY_IMAGE_PROCESSOR, "video_processor": TINY_VIDEO_PROCESSOR,
        "processor_class": "Qwen3VLProcessor"}))
    assert load_processor_config(nested) == split
    assert load_processor_config(tmp_path / "nothing") is None
    shutil.copy(release / "preprocessor_config.json", tmp_path / "preprocessor_config.json")
    (tmp_path / "preprocessor_config.json").write_text("{")
    with pytest.raises(errors.CorruptModel):
        load_processor_config(tmp_path)
