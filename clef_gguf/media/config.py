"""The release's processor settings and a request's ``media_kwargs``, as transformers 5.23 reads them.

A release directory holds either the Hub's split files (``preprocessor_config.json`` for the image
processor, ``video_preprocessor_config.json`` for the video processor) or the one nested
``processor_config.json`` (``{"image_processor": {...}, "video_processor": {...}}``) that
``Qwen3VLProcessor.save_pretrained`` writes. Keys a file leaves out take the class defaults of
``Qwen2VLImageProcessor`` / ``Qwen3VLVideoProcessor``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from clef_gguf.core import errors

PROCESSOR_FILE = "processor_config.json"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"

# PIL resampling codes the processors store -> torch interpolate modes (torchvision's mapping).
RESAMPLE_MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}

_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_IMAGE_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}, "patch_size": 14,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": _OPENAI_CLIP_MEAN, "image_std": _OPENAI_CLIP_STD,
    "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True, "do_normalize": True, "resample": 3,
}
_VIDEO_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5),
    "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True, "do_normalize": True, "resample": 3,
    "do_sample_frames": True, "fps": 2, "min_frames": 4, "max_frames": 768, "num_frames": None,
}
# Frame lists carry no timing; the processor then assumes 24 frames per second for the timestamps.
FRAME_LIST_FPS = 24.0


@dataclass(frozen=True)
class VisionSettings:
    """One processor's settings (image or video)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    shortest_edge: int  # min pixels (for videos: frames x height x width)
    longest_edge: int  # max pixels
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_resize: bool
    do_rescale: bool
    do_normalize: bool
    resample: str
    do_sample_frames: bool = False
    # Frame sampling of a video file (``Qwen3VLVideoProcessor.sample_frames``): ``fps`` frames per second
    # clamped to [min_frames, max_frames], or exactly ``num_frames``; the two are exclusive there.
    fps: float | None = None
    min_frames: int = 4
    max_frames: int = 768
    num_frames: int | None = None

    @property
    def factor(self) -> int:
        """Pixels per merged token along one side (patch x merge)."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ProcessorConfig:
    image: VisionSettings
    video: VisionSettings


@dataclass(frozen=True)
class MediaOptions:
    """The ``media_kwargs`` the processor honours; ``None`` = the release's setting."""

    size: tuple[int, int] | None = None  # (shortest_edge, longest_edge), images and videos
    min_pixels: int | None = None  # images only, over ``size``
    max_pixels: int | None = None
    do_sample_frames: bool | None = None
    fps: float | None = None
    fps_null: bool = False  # "fps": null, which the reference needs to sample by num_frames alone
    num_frames: int | None = None


def _settings(raw: Mapping[str, Any], defaults: Mapping[str, Any], where: str) -> VisionSettings:
    merged = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
    size = dict(merged["size"]) if isinstance(merged["size"], Mapping) else {}
    if defaults is _IMAGE_DEFAULTS:  # Qwen2VLImageProcessor.__init__: min/max_pixels override size
        if raw.get("min_pixels") is not None:
            size["shortest_edge"] = raw["min_pixels"]
        if raw.get("max_pixels") is not None:
            size["longest_edge"] = raw["max_pixels"]
    try:
        resample = RESAMPLE_MODES[int(merged["resample"])]
        return VisionSettings(
            patch_size=int(merged["patch_size"]), temporal_patch_size=int(merged["temporal_patch_size"]),
            merge_size=int(merged["merge_size"]), shortest_edge=int(size["shortest_edge"]),
            longest_edge=int(size["longest_edge"]), image_mean=tuple(float(x) for x in merged["image_mean"]),
            image_std=tuple(float(x) for x in merged["image_std"]),
            rescale_factor=float(merged["rescale_factor"]), do_resize=bool(merged["do_resize"]),
            do_rescale=bool(merged["do_rescale"]), do_normalize=bool(merged["do_normalize"]),
            resample=resample, do_sample_frames=bool(merged.get("do_sample_frames", False)),
            **_sampling(raw, defaults))
    except (KeyError, TypeError, ValueError) as exc:
        raise errors.CorruptModel(f"unreadable {where}: {exc!r}") from None


def _sampling(raw: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The video processor's frame-sampling keys; a ``null`` in the file is None there (not the default)."""
    if "fps" not in defaults:
        return {}
    fps = raw["fps"] if "fps" in raw else defaults["fps"]
    num = raw.get("num_frames", defaults["num_frames"])
    return {"fps": None if fps is None else float(fps), "num_frames": None if num is None else int(num),
            "min_frames": int(raw.get("min_frames") or defaults["min_frames"]),
            "max_frames": int(raw.get("max_frames") or defaults["max_frames"])}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise errors.CorruptModel(f"unreadable {path.name}: {exc}") from None
    if not isinstance(data, dict):
        raise errors.CorruptModel(f"{path.name} is not a JSON object")
    return data


def load_processor_config(directory: str | Path) -> ProcessorConfig | None:
    """The processor settings of a release or model directory; None when it has none."""
    directory = Path(directory)
    image_raw: dict[str, Any] | None = None
    video_raw: dict[str, Any] | None = None
    if (directory / PROCESSOR_FILE).is_file():
        nested = _read_json(directory / PROCESSOR_FILE)
        image_raw, video_raw = nested.get("image_processor"), nested.get("video_processor")
    if image_raw is None and (directory / IMAGE_PROCESSOR_FILE).is_file():
        image_raw = _read_json(directory / IMAGE_PROCESSOR_FILE)
    if video_raw is None and (directory / VIDEO_PROCESSOR_FILE).is_file():
        video_raw = _read_json(directory / VIDEO_PROCESSOR_FILE)
    if image_raw is None and video_raw is None:
        return None
    # transformers falls back to the image file for a video processor saved without its own file.
    return ProcessorConfig(image=_settings(image_raw or {}, _IMAGE_DEFAULTS, IMAGE_PROCESSOR_FILE),
                           video=_settings(video_raw or image_raw or {}, _VIDEO_DEFAULTS, VIDEO_PROCESSOR_FILE))


def _positive_int(value: Any, field: str, unit: str = "pixels") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise errors.InvalidValue(f"must be a positive integer ({unit})", field=field)
    return value


def parse_media_kwargs(media_kwargs: Mapping[str, Any] | None) -> tuple[MediaOptions, list[str]]:
    """``media_kwargs`` -> the options honoured and one warning per key ignored."""
    options, warnings = MediaOptions(), []
    for key, value in (media_kwargs or {}).items():
        field = f"media_kwargs.{key}"
        if key == "size":
            if not isinstance(value, Mapping) or set(value) != {"shortest_edge", "longest_edge"}:
                raise errors.InvalidValue("size must be {\"shortest_edge\": pixels, \"longest_edge\": pixels}",
                                          field=field)
            options = replace(options, size=(_positive_int(value["shortest_edge"], f"{field}.shortest_edge"),
                                              _positive_int(value["longest_edge"], f"{field}.longest_edge")))
        elif key == "min_pixels":
            options = replace(options, min_pixels=_positive_int(value, field))
        elif key == "max_pixels":
            options = replace(options, max_pixels=_positive_int(value, field))
        elif key == "do_sample_frames":
            if not isinstance(value, bool):
                raise errors.InvalidValue("must be true or false", field=field)
            options = replace(options, do_sample_frames=value)
        elif key == "num_frames":
            options = replace(options, num_frames=_positive_int(value, field, "frames"))
        elif key == "fps" and value is None:
            options = replace(options, fps_null=True)
        elif key == "fps":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise errors.InvalidValue("must be a positive number", field=field)
            options = replace(options, fps=float(value))
        else:
            warnings.append(f"media_kwargs.{key} is ignored")
    return options, warnings


def image_settings(config: ProcessorConfig, options: MediaOptions) -> VisionSettings:
    """The image processor's settings for one call (``size``, then ``min_pixels``/``max_pixels``)."""
    settings = config.image
    if options.size is not None:
        settings = replace(settings, shortest_edge=options.size[0], longest_edge=options.size[1])
    if options.min_pixels is not None:
        settings = replace(settings, shortest_edge=options.min_pixels)
    if options.max_pixels is not None:
        settings = replace(settings, longest_edge=options.max_pixels)
    return settings


def video_settings(config: ProcessorConfig, options: MediaOptions) -> VisionSettings:
    """The video processor's settings for one call (``size`` only: it has no min/max_pixels)."""
    settings = config.video
    if options.size is not None:
        settings = replace(settings, shortest_edge=options.size[0], longest_edge=options.size[1])
    if options.do_sample_frames is not None:
        settings = replace(settings, do_sample_frames=options.do_sample_frames)
    if options.fps is not None or options.fps_null:
        settings = replace(settings, fps=options.fps)
    if options.num_frames is not None:
        settings = replace(settings, num_frames=options.num_frames)
    return settings
