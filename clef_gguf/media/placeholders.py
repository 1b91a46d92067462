"""The media part of the prompt: the reference's placeholders as the processor expands them.

The reference writes ``IMAGE_PLACEHOLDER * images + VIDEO_PLACEHOLDER * videos + "\\n"`` and
``Qwen3VLProcessor`` replaces each ``<|image_pad|>`` by ``t * h * w / merge^2`` of them and each
``<|video_pad|>`` by, per temporal group, ``<t seconds><|vision_start|><|video_pad|> * k<|vision_end|>``
(inside the placeholder's own vision markers, so those appear twice around a video).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import PIL.Image
import torch

from clef_gguf.media.config import MediaOptions, ProcessorConfig, image_settings, video_settings
from clef_gguf.media.processor import ImageBatch, VideoBatch, preprocess_images, preprocess_videos
from clef_gguf.media.video_files import DecodedVideo

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
VIDEO_PLACEHOLDER = VISION_START + VIDEO_PAD + VISION_END
SPECIAL_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# One piece of the expanded text: (text, repeat). Special tokens come as themselves with their count;
# timestamps and the final newline are plain text the tokenizer encodes (special tokens around them
# split the text, so encoding piece by piece gives the ids of encoding the whole string).
Piece = tuple[str, int]


@dataclass(frozen=True)
class PreparedMedia:
    images: ImageBatch | None
    videos: VideoBatch | None
    pieces: tuple[Piece, ...]
    image_tokens: tuple[int, ...]  # <|image_pad|> count per image
    video_tokens: tuple[int, ...]  # <|video_pad|> count per video (all temporal groups)

    @property
    def text(self) -> str:
        """The expanded prompt text the reference's processor tokenizes."""
        return expanded_text(self.pieces)


def token_counts(grid_thw: torch.Tensor, merge_size: int) -> tuple[int, ...]:
    """Tokens per image or video: ``t * h * w / merge^2``."""
    return tuple(int(t * h * w) // merge_size ** 2 for t, h, w in grid_thw.tolist())


def media_pieces(image_grid_thw: torch.Tensor | None, video_grid_thw: torch.Tensor | None,
                 timestamps: Sequence[Sequence[str]], merge_size: int, video_merge_size: int) -> list[Piece]:
    """The processor's expansion of the reference's placeholder text, as (text, repeat) pieces."""
    pieces: list[Piece] = []
    for count in token_counts(image_grid_thw, merge_size) if image_grid_thw is not None else ():
        pieces += [(VISION_START, 1), (IMAGE_PAD, count), (VISION_END, 1)]
    for v, (t, h, w) in enumerate(video_grid_thw.tolist() if video_grid_thw is not None else ()):
        per_group = int(h * w) // video_merge_size ** 2
        pieces.append((VISION_START, 1))
        for group in range(int(t)):
            pieces += [(timestamps[v][group], 1), (VISION_START, 1), (VIDEO_PAD, per_group), (VISION_END, 1)]
        pieces.append((VISION_END, 1))
    pieces.append(("\n", 1))
    return pieces


def expanded_text(pieces: Sequence[Piece]) -> str:
    return "".join(text * count for text, count in pieces)


def prepare_media(images: Sequence[PIL.Image.Image], videos: Sequence[Sequence[PIL.Image.Image] | DecodedVideo],
                  config: ProcessorConfig, options: MediaOptions,
                  image_fields: Sequence[str] | None = None,
                  video_fields: Sequence[str] | None = None) -> PreparedMedia:
    """Decoded images, frame lists and video files -> the tower's inputs and the expanded prompt pieces."""
    image_cfg, video_cfg = image_settings(config, options), video_settings(config, options)
    image_batch = preprocess_images(images, image_cfg, image_fields) if images else None
    video_batch = preprocess_videos(videos, video_cfg, video_fields) if videos else None
    pieces = media_pieces(image_batch.grid_thw if image_batch else None,
                          video_batch.grid_thw if video_batch else None,
                          video_batch.timestamps if video_batch else (), image_cfg.merge_size, video_cfg.merge_size)
    return PreparedMedia(
        images=image_batch, videos=video_batch, pieces=tuple(pieces),
        image_tokens=token_counts(image_batch.grid_thw, image_cfg.merge_size) if image_batch else (),
        video_tokens=token_counts(video_batch.grid_thw, video_cfg.merge_size) if video_batch else ())
