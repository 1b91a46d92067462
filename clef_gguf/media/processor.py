"""RGB images and frame lists -> the vision tower's patches, equal to the reference's processor.

The reference runs ``Qwen3VLProcessor`` with transformers' torchvision backend on CPU: each picture
as a ``[3, H, W]`` uint8 tensor, ``smart_resize`` to multiples of ``patch x merge``, torchvision's
``resize`` (for uint8 bicubic on CPU that is ``torch.nn.functional.interpolate(mode="bicubic",
antialias=True, align_corners=False)`` on the uint8 tensor itself, torch's native uint8 kernel), the
fused rescale + normalize in float32, then the patch layout. The same torch calls in the same order
here give the same bits without torchvision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import PIL.Image
import torch
from torch.nn.functional import interpolate

from clef_gguf.core import errors
from clef_gguf.media.config import FRAME_LIST_FPS, VisionSettings
from clef_gguf.media.video_files import DecodedVideo

MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageBatch:
    pixel_values: torch.Tensor  # float32 [patches, C * T * P * P]
    grid_thw: torch.Tensor  # int64 [images, 3]


@dataclass(frozen=True)
class VideoBatch:
    pixel_values: torch.Tensor  # float32 [patches, C * T * P * P]
    grid_thw: torch.Tensor  # int64 [videos, 3]
    timestamps: tuple[tuple[str, ...], ...]  # per video, per temporal group: "<0.0 seconds>"


def _aspect_check(height: int, width: int, field: str) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise errors.InvalidMedia(f"aspect ratio {max(height, width) / min(height, width):g} is over "
                                  f"{MAX_ASPECT_RATIO}", field=field)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 field: str = "images") -> tuple[int, int]:
    """Qwen2-VL's image size rule: multiples of ``factor`` (half to even), pixels within the bounds."""
    _aspect_check(height, width, field)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int, field: str = "videos") -> tuple[int, int]:
    """Qwen3-VL's video size rule: the pixel bounds count every frame (padded to the temporal patch)."""
    if frames < temporal_factor:
        raise errors.InvalidMedia(f"a video needs at least {temporal_factor} frames, got {frames}", field=field)
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _aspect_check(height, width, field)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_tensor(image: PIL.Image.Image) -> torch.Tensor:
    """An RGB image -> ``[3, H, W]`` uint8, what torchvision's decoder hands the processor."""
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


def resize(pixels: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    """torchvision's ``resize_image`` on CPU for ``[..., C, H, W]``: uint8 stays uint8 for bicubic (and
    for bilinear where torch has its AVX2 kernel), else a float32 round trip with clamp and round."""
    *lead, channels, old_height, old_width = pixels.shape
    if (height, width) == (old_height, old_width):
        return pixels
    native = mode == "nearest" or mode == "bicubic" or (
        mode == "bilinear" and "AVX2" in torch.backends.cpu.get_cpu_capability())
    dtype = pixels.dtype
    batch = pixels.reshape(-1, channels, old_height, old_width)
    cast = dtype not in (torch.float32, torch.float64) and not (dtype == torch.uint8 and native)
    if cast:
        batch = batch.to(torch.float32)
    antialias = mode in ("bilinear", "bicubic")
    align = False if antialias else None
    batch = interpolate(batch, size=[height, width], mode=mode, align_corners=align, antialias=antialias)
    if cast:
        if mode == "bicubic" and dtype == torch.uint8:
            batch = batch.clamp_(min=0, max=255)
        batch = batch.round_().to(dtype)
    return batch.reshape(*lead, channels, height, width)


def rescale_and_normalize(pixels: torch.Tensor, settings: VisionSettings) -> torch.Tensor:
    """The backend's fused step: (x - mean / scale) / (std / scale) in float32, as torchvision normalizes."""
    if settings.do_normalize:
        mean = torch.tensor(settings.image_mean)
        std = torch.tensor(settings.image_std)
        if settings.do_rescale:
            mean = mean * (1.0 / settings.rescale_factor)
            std = std * (1.0 / settings.rescale_factor)
        out = pixels.to(torch.float32)
        return out.sub(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    if settings.do_rescale:
        return pixels * settings.rescale_factor
    return pixels


def _patchify_image(pixels: torch.Tensor, s: VisionSettings) -> torch.Tensor:
    """``[1, C, H, W]`` -> ``[gh * gw, C * T * P * P]``, merge blocks contiguous, the picture repeated T times."""
    _, channels, height, width = pixels.shape
    p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
    gh, gw = height // p, width // p
    patches = pixels.reshape(1, channels, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
    patches = patches.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1)
    return patches.reshape(gh * gw, channels * t * p * p)


def _patchify_video(pixels: torch.Tensor, s: VisionSettings) -> tuple[torch.Tensor, int]:
    """``[F, C, H, W]`` -> ``[gt * gh * gw, C * T * P * P]``; the last frame repeats up to a multiple of T."""
    p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
    if pad := -pixels.shape[0] % t:
        pixels = torch.cat((pixels, pixels[-1:].expand(pad, -1, -1, -1)), dim=0)
    frames, channels, height, width = pixels.shape
    gt, gh, gw = frames // t, height // p, width // p
    patches = pixels.reshape(gt, t, channels, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, channels * t * p * p), gt


def preprocess_images(images: Sequence[PIL.Image.Image], settings: VisionSettings,
                      fields: Sequence[str] | None = None) -> ImageBatch:
    """RGB images -> ``pixel_values`` and ``image_grid_thw`` equal to ``Qwen2VLImageProcessor``'s."""
    chunks, grids = [], []
    for i, image in enumerate(images):
        field = fields[i] if fields is not None else f"images.{i}"
        pixels = to_tensor(image).unsqueeze(0)
        if settings.do_resize:
            height, width = smart_resize(pixels.shape[-2], pixels.shape[-1], settings.factor,
                                         settings.shortest_edge, settings.longest_edge, field)
            pixels = resize(pixels, height, width, settings.resample)
        pixels = rescale_and_normalize(pixels, settings)
        chunks.append(_patchify_image(pixels, settings))
        grids.append([1, pixels.shape[-2] // settings.patch_size, pixels.shape[-1] // settings.patch_size])
    return ImageBatch(pixel_values=torch.cat(chunks, dim=0), grid_thw=torch.tensor(grids, dtype=torch.long))


def frame_timestamps(indices: Sequence[int], temporal_patch_size: int, fps: float = FRAME_LIST_FPS) -> tuple[str, ...]:
    """``Qwen3VLProcessor``'s timestamps: per temporal group the mean time of its first and last frame
    (the last frame index repeated to fill the group), written ``<{t:.1f} seconds>``. Frame lists are
    indices 0..n-1 at 24 fps; a video file, its sampled indices at its own rate."""
    indices = list(indices)
    if len(indices) % temporal_patch_size:
        indices.extend(indices[-1] for _ in range(temporal_patch_size - len(indices) % temporal_patch_size))
    times = [index / fps for index in indices]
    groups = [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]
    return tuple(f"<{time:.1f} seconds>" for time in groups)


def _frames(video: Sequence[PIL.Image.Image] | DecodedVideo, settings: VisionSettings,
            field: str) -> tuple[torch.Tensor, Sequence[int], float]:
    """One video's uint8 ``[F, 3, H, W]`` frames, the indices and frame rate its timestamps count."""
    if isinstance(video, DecodedVideo):  # already sampled as the processor samples a file
        return video.frames, video.indices, video.fps
    if settings.do_sample_frames:
        raise errors.InvalidMedia("frames given as images need media_kwargs.do_sample_frames = false",
                                  field=field)
    if not video:
        raise errors.InvalidMedia("a video needs at least one frame", field=field)
    tensors = [to_tensor(frame) for frame in video]
    if any(t.shape != tensors[0].shape for t in tensors):
        raise errors.InvalidMedia("the frames of a video must all have the same size", field=field)
    return torch.stack(tensors, dim=0), range(len(tensors)), FRAME_LIST_FPS


def preprocess_videos(videos: Sequence[Sequence[PIL.Image.Image] | DecodedVideo], settings: VisionSettings,
                      fields: Sequence[str] | None = None) -> VideoBatch:
    """Frame lists and decoded video files -> ``pixel_values_videos``, ``video_grid_thw`` and timestamps
    equal to ``Qwen3VLVideoProcessor`` + ``Qwen3VLProcessor``: frame lists need ``do_sample_frames=False``
    (the reference refuses to sample frames from a list of images); files come sampled."""
    chunks, grids, stamps = [], [], []
    for i, video in enumerate(videos):
        field = fields[i] if fields is not None else f"videos.{i}"
        pixels, indices, fps = _frames(video, settings, field)
        if settings.do_resize:
            height, width = smart_resize_video(pixels.shape[0], pixels.shape[-2], pixels.shape[-1],
                                               settings.temporal_patch_size, settings.factor,
                                               settings.shortest_edge, settings.longest_edge, field)
            pixels = resize(pixels, height, width, settings.resample)
        pixels = rescale_and_normalize(pixels, settings)
        patches, gt = _patchify_video(pixels, settings)
        chunks.append(patches)
        grids.append([gt, pixels.shape[-2] // settings.patch_size, pixels.shape[-1] // settings.patch_size])
        stamps.append(frame_timestamps(indices, settings.temporal_patch_size, fps))
    return VideoBatch(pixel_values=torch.cat(chunks, dim=0), grid_thw=torch.tensor(grids, dtype=torch.long),
                      timestamps=tuple(stamps))
