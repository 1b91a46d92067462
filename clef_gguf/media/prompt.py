"""A request's images and videos -> the ids they add to the prompt and the ``MediaPrompt`` the tower
decodes: read the sources (``sources``), process the pixels (``placeholders.prepare_media``), tokenize
the expanded placeholder text, find each run of pad tokens, and defer the vision tower to the decode
(``MediaPrompt.embed``), so that a cached state about the same pictures never runs it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import PIL.Image
import torch

from clef_gguf.core import errors
from clef_gguf.media.config import ProcessorConfig, VisionSettings, parse_media_kwargs, video_settings
from clef_gguf.media.placeholders import IMAGE_PAD, VIDEO_PAD, PreparedMedia, prepare_media
from clef_gguf.media.sources import MediaPolicy, check_count, load_images, load_video_frames
from clef_gguf.media.video_files import DecodedVideo, load_video
from clef_gguf.pipeline.mediaprompt import MediaPrompt, MediaRows, Run, positions
from clef_gguf.vision.cache import pixels_digest

if TYPE_CHECKING:
    from clef_gguf.pipeline.encode import Encoded, Encoder
    from clef_gguf.pipeline.request import Request
    from clef_gguf.vision.cache import CachedVision


@dataclass(frozen=True)
class MediaTokens:
    """What the media add to one prompt before it is encoded: their ids (to place before the state),
    the runs of pad tokens in those ids, and how to compute the runs' embeddings."""

    ids: tuple[int, ...]
    runs: tuple[Run, ...]  # relative to ``ids``
    digest: str
    compute: Callable[[], MediaRows]
    warnings: tuple[str, ...]

    def attach(self, encoded: Encoded) -> Encoded:
        """``encoded`` (made with these ids right after its prefix) with its ``MediaPrompt``."""
        at = encoded.prefix_tokens
        runs = tuple(Run(r.start + at, r.end + at, r.rows, r.cols) for r in self.runs)
        media = MediaPrompt(runs, positions(encoded.n_tokens, runs), self.digest, self.compute)
        return replace(encoded, media=media)


def video_frames(video: Any, field: str) -> list[str] | str:
    """One entry of ``videos`` as the reference's processor reads it: a file path or URL (a string), or
    ``[[frame, ...]]``, one list of frames for this video's one placeholder. A flat ``[frame, ...]`` is
    several videos for one placeholder there, which it refuses; so do we, saying what to send."""
    if isinstance(video, str):
        return video
    if isinstance(video, list) and len(video) == 1 and isinstance(video[0], list) \
            and all(isinstance(f, str) for f in video[0]):
        return video[0]
    if isinstance(video, list) and video and all(isinstance(f, str) for f in video):
        raise errors.InvalidMedia("a video is a file path or URL, or a list holding its list of frames: "
                                  "[[frame1, frame2, ...]] "
                                  "(a flat list of frames is read as several videos for one placeholder)",
                                  field=field)
    raise errors.InvalidMedia("a video is a file path or URL, or [[frame1, frame2, ...]]: one list of frames "
                              "(image strings)", field=field)


def _load_videos(entries: list[list[str] | str], policy: MediaPolicy,
                 settings: VisionSettings) -> list[list[PIL.Image.Image] | DecodedVideo]:
    """Each video's frames: a file decoded and sampled as the processor does, or its frame images."""
    videos: list[list[PIL.Image.Image] | DecodedVideo] = []
    spent = 0  # decoded pixels of the request's video files so far (one budget for them all)
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            video = load_video(entry, policy, settings, f"videos.{i}", spent)
            spent += video.frames.numel() // 3
            videos.append(video)
        else:
            videos.append(load_video_frames(entry, policy, f"videos.{i}.0"))
    return videos


def _tokenize(encoder: Encoder, text: str) -> tuple[int, ...]:
    return tuple(encoder.tokenizer.encode(text, add_special_tokens=False).ids)


def _pad_runs(prepared: PreparedMedia, config: ProcessorConfig) -> list[tuple[str, int, int]]:
    """(pad text, rows, cols) of every run, in prompt order: each image, then each temporal group of
    each video."""
    out: list[tuple[str, int, int]] = []
    if prepared.images is not None:
        m = config.image.merge_size
        out += [(IMAGE_PAD, h // m, w // m) for _, h, w in prepared.images.grid_thw.tolist()]
    if prepared.videos is not None:
        m = config.video.merge_size
        for t, h, w in prepared.videos.grid_thw.tolist():
            out += [(VIDEO_PAD, h // m, w // m)] * int(t)
    return out


def _batches(prepared: PreparedMedia) -> list[tuple[str, Any, bytes]]:
    """(kind, batch, its pixels' digest) of the images and videos: each batch hashed once, here on a
    tokenizer thread, for both the prompt caches' keys and the vision cache's."""
    return [(kind, batch, pixels_digest(batch.pixel_values, batch.grid_thw))
            for kind, batch in (("images", prepared.images), ("videos", prepared.videos)) if batch is not None]


def _digest(batches: list[tuple[str, Any, bytes]]) -> str:
    """The pixels and grids the vision tower sees: equal digests, equal embeddings."""
    return hashlib.sha256(b"".join(kind.encode() + hashed for kind, _batch, hashed in batches)).hexdigest()


def media_tokens(request: Request, config: ProcessorConfig, policy: MediaPolicy, encoder: Encoder,
                 vision: Callable[[], CachedVision]) -> MediaTokens:
    """The media of ``request`` for this model; every refusal names its field (``images.1``...).
    ``vision`` gives the loaded vision tower behind its cache (it loads on the first picture that needs it)."""
    options, warnings = parse_media_kwargs(request.media_kwargs)
    frames = [video_frames(v, f"videos.{i}") for i, v in enumerate(request.videos)]
    # A video file counts as one item here; its frames have their own limits (MediaPolicy.max_video_*).
    check_count(len(request.images) + sum(1 if isinstance(f, str) else len(f) for f in frames), policy,
                "images" if request.images else "videos")
    images: list[PIL.Image.Image] = load_images(request.images, policy) if request.images else []
    videos = _load_videos(frames, policy, video_settings(config, options))
    prepared = prepare_media(images, videos, config, options,
                             video_fields=[f"videos.{i}" for i in range(len(videos))])
    ids: list[int] = []
    for text, count in prepared.pieces:
        ids += _tokenize(encoder, text) * count
    pad_ids = {text: _tokenize(encoder, text) for text in (IMAGE_PAD, VIDEO_PAD)}
    runs, at = [], 0
    for text, rows, cols in _pad_runs(prepared, config):
        pad = pad_ids[text]
        if len(pad) != 1:
            raise errors.CorruptModel(f"the tokenizer has no single token for {text}", field="tokenizer")
        start = ids.index(pad[0], at)
        runs.append(Run(start, start + rows * cols, rows, cols))
        at = start + rows * cols
        if ids[start:at] != [pad[0]] * (rows * cols):
            raise errors.InferenceError(f"the expanded media text does not hold {rows * cols} {text} in a row")

    batches = _batches(prepared)

    def compute() -> MediaRows:
        tower = vision()
        parts = [tower.embed(batch.pixel_values, batch.grid_thw, hashed) for _kind, batch, hashed in batches]
        # cat copies: a cached entry is never handed out to be written to
        return MediaRows(torch.cat([p.rows for p in parts]).numpy(), sum(p.cached_tokens for p in parts))

    return MediaTokens(tuple(ids), tuple(runs), _digest(batches), compute, tuple(warnings))


def unsupported(request: Request, why: str) -> errors.Unsupported:
    """The error for media sent to a model that cannot see them."""
    return errors.Unsupported(f"{'images' if request.images else 'videos'} are not supported here: {why}",
                              field="images" if request.images else "videos")
