"""One video file (a path or URL) -> its sampled RGB frames and timing, as the reference's processor reads it.

The reference hands ``videos: ["clip.mp4"]`` to ``Qwen3VLVideoProcessor``, which decodes it with
transformers' ``video_utils.load_video`` and samples it with its own ``sample_frames``. That loader's
default decoder, torchcodec, does not load beside the CPU torch here; its PyAV decoder
(``read_video_pyav``) decodes the same FFmpeg frames, and this module does what it does, step by step:
the metadata from the container's first video stream (``frames``, ``average_rate``), the sampled
indices (``sample_indices``), every frame decoded in order up to the last index, the sampled ones
converted with ``to_ndarray(format="rgb24")``. The frames then go through the same processor path as a
list of frames (``processor.preprocess_videos``), with the file's frame rate and sampled indices for
the timestamps.

Untrusted files are bounded before decoding, by their container's metadata (duration, frame size,
frames kept, decoded pixels kept: ``MediaPolicy``), and while decoding by a deadline. Only the common
container formats are opened (``CONTAINERS``): a playlist format such as HLS would make FFmpeg open the
URLs or files it lists. Every refusal names the field (``videos.0``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

import numpy as np
import torch

from clef_gguf.core import errors, refusals
from clef_gguf.media.config import VisionSettings
from clef_gguf.media.sources import MediaPolicy, open_source

if TYPE_CHECKING:
    from av.container import InputContainer

# FFmpeg demuxer names (its ``format_whitelist``): MP4/MOV, Matroska/WebM, AVI, MPEG-PS/TS, Ogg, FLV.
CONTAINERS = "mov,mp4,matroska,webm,avi,mpeg,mpegts,ogg,flv"


@dataclass(frozen=True)
class DecodedVideo:
    """A video file's sampled frames, as ``read_video_pyav`` returns them, ready for the processor."""

    frames: torch.Tensor  # uint8 [frames, 3, height, width], the distinct sampled frames in order
    fps: float  # the container's average frame rate (the timestamps' clock)
    indices: tuple[int, ...]  # the sampled frame indices (the timestamps; may repeat an index)
    total_frames: int
    duration: float  # total_frames / fps, as the reference computes it


def sample_indices(total: int, video_fps: float, settings: VisionSettings) -> list[int]:
    """``Qwen3VLVideoProcessor.sample_frames``: ``fps`` frames per second of the video, clamped to
    [min_frames, max_frames] and to the video's frames, or exactly ``num_frames``, spread evenly with
    numpy's rounding; with ``do_sample_frames`` false, every frame (``load_video``'s default)."""
    if not settings.do_sample_frames:
        return list(range(total))
    fps, count = settings.fps, settings.num_frames
    if fps is not None and count is not None:
        raise errors.InvalidValue("num_frames and fps are exclusive in the reference's processor (its fps "
                                  "defaults to the release's); send \"fps\": null with num_frames",
                                  field="media_kwargs.num_frames")
    if count is None and fps is not None:
        count = int(total / video_fps * fps)
        count = min(max(count, settings.min_frames), settings.max_frames, total)
    if count is None:
        count = min(max(total, settings.min_frames), settings.max_frames)
    return [int(i) for i in np.linspace(0, total - 1, count).round().astype(int)]


def load_video(source: str, policy: MediaPolicy, settings: VisionSettings, field: str,
               pixels_spent: int = 0) -> DecodedVideo:
    """A video path or URL -> its sampled frames; ``pixels_spent``: decoded pixels the request's other
    video files already hold (``policy.max_video_pixels`` bounds them all together)."""
    with open_source(source, policy, field) as file:
        return decode_video(file, policy, settings, field, pixels_spent)


def decode_video(file: IO[bytes], policy: MediaPolicy, settings: VisionSettings, field: str,
                 pixels_spent: int = 0) -> DecodedVideo:
    """An open video file -> its sampled frames (``read_video_pyav``'s steps), within the policy's limits."""
    import av  # here: a text-only process never loads FFmpeg

    try:
        container = av.open(file, mode="r", options={"format_whitelist": CONTAINERS})
    except (av.error.FFmpegError, OSError, ValueError, EOFError):  # PyAV's file reader raises OSError too
        raise errors.InvalidMedia("not a video file in a container we open (MP4/MOV, WebM/Matroska, AVI, "
                                  "MPEG, Ogg, FLV), or corrupt or truncated", field=field) from None
    with container:
        try:
            return _decode(container, policy, settings, field, pixels_spent)
        except errors.ClefError:
            raise
        except (av.error.FFmpegError, OSError, ValueError, EOFError, MemoryError):
            raise errors.InvalidMedia("the video data is corrupt or truncated", field=field) from None


def _decode(container: InputContainer, policy: MediaPolicy, settings: VisionSettings,
            field: str, pixels_spent: int) -> DecodedVideo:
    if not container.streams.video:
        raise errors.InvalidMedia("the file has no video stream (audio only?)", field=field)
    stream = container.streams.video[0]
    total, rate = int(stream.frames), stream.average_rate
    width, height = int(stream.width or 0), int(stream.height or 0)
    if not rate or rate <= 0:
        raise errors.InvalidMedia("the video's container records no frame rate", field=field)
    if total <= 0:
        # read_video_pyav samples from the container's frame count; without one (WebM and Matroska
        # do not store it) the reference fails too.
        raise errors.InvalidMedia("the video's container records no frame count (zero frames, or a "
                                  "WebM/Matroska/MPEG-TS file: re-encode it as MP4)", field=field)
    if width < 1 or height < 1:
        raise errors.InvalidMedia("the video's frames have no size", field=field)
    fps = float(rate)
    duration = total / fps
    if duration > policy.max_video_seconds:
        raise errors.MediaTooLarge(refusals.canvas(f"the video lasts {duration:.1f} s ({total} frames at {fps:g} "
                                                   f"fps), over the limit of {policy.max_video_seconds:g} s",
                                                   f"{policy.max_video_seconds:g} s of video"), field=field)
    if width * height > policy.max_pixels:
        raise errors.MediaTooLarge(refusals.canvas(f"the video's frames have {width}x{height} pixels, over the "
                                                   f"budget of {policy.max_pixels}", f"{policy.max_pixels} pixels"),
                                   field=field)
    indices = sample_indices(total, fps, settings)
    wanted = sorted(set(indices))
    if len(wanted) > policy.max_video_frames:
        raise errors.MediaTooLarge(refusals.canvas(f"{len(wanted)} frames sampled from the video, over the limit "
                                                   f"of {policy.max_video_frames} frames (lower media_kwargs.fps)",
                                                   f"{policy.max_video_frames} frames"), field=field)
    if pixels_spent + len(wanted) * width * height > policy.max_video_pixels:
        raise errors.MediaTooLarge(refusals.canvas(f"{len(wanted)} frames of {width}x{height} pixels, over the "
                                                   f"budget of {policy.max_video_pixels} decoded video pixels per "
                                                   "request", f"{policy.max_video_pixels} video pixels"), field=field)
    frames = _read_frames(container, wanted, policy, field)
    if len(frames) < len(wanted):
        raise errors.InvalidMedia(f"the video is truncated: {len(frames)} of the {len(wanted)} sampled frames "
                                  f"could be decoded (its container says {total} frames)", field=field)
    shape = frames[0].shape
    if any(f.shape != shape for f in frames):  # np.stack refuses them in the reference
        raise errors.InvalidMedia("the video's frames change size", field=field)
    pixels = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()
    return DecodedVideo(frames=pixels, fps=fps, indices=tuple(indices), total_frames=total, duration=duration)


def _read_frames(container: InputContainer, wanted: Sequence[int], policy: MediaPolicy,
                 field: str) -> list[np.ndarray]:
    """Every frame decoded in order up to the last one wanted; the wanted ones as RGB arrays, each size
    checked as it comes (a stream may change size past its header). Bounded by the decode deadline."""
    deadline = time.monotonic() + policy.video_decode_s
    keep, last = set(wanted), wanted[-1]
    frames: list[np.ndarray] = []
    container.seek(0)
    for i, frame in enumerate(container.decode(video=0)):
        if i > last:
            break
        if i in keep:
            if frame.width * frame.height > policy.max_pixels:
                raise errors.MediaTooLarge(refusals.canvas(f"a video frame has {frame.width}x{frame.height} pixels, "
                                                           f"over the budget of {policy.max_pixels}",
                                                           f"{policy.max_pixels} pixels"), field=field)
            frames.append(frame.to_ndarray(format="rgb24"))
        if time.monotonic() > deadline:
            raise errors.MediaTooLarge(refusals.canvas(f"decoding the video took over {policy.video_decode_s:g} s "
                                                       f"({i + 1} frames decoded)",
                                                       f"what decodes in {policy.video_decode_s:g} s"), field=field)
    return frames
