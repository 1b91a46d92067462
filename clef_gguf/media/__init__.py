"""Images and videos for the vision tower, as the reference's processor prepares them.

``sources`` turns an image string into an RGB picture under a ``MediaPolicy``; ``config`` reads the
release's processor files and a request's ``media_kwargs``; ``processor`` does the pixel math;
``placeholders`` expands the reference's placeholder text; ``video_files`` decodes and samples a video
file as the reference's video processor does.
"""

from clef_gguf.media.config import (MediaOptions, ProcessorConfig, VisionSettings, load_processor_config,
                                    parse_media_kwargs)
from clef_gguf.media.placeholders import (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, PreparedMedia, media_pieces,
                                          prepare_media, token_counts)
from clef_gguf.media.processor import ImageBatch, VideoBatch, preprocess_images, preprocess_videos
from clef_gguf.media.sources import (INLINE_ONLY, MediaPolicy, load_image, load_images, load_video_frames,
                                     read_source)
from clef_gguf.media.video_files import DecodedVideo, load_video

__all__ = ["IMAGE_PLACEHOLDER", "INLINE_ONLY", "VIDEO_PLACEHOLDER", "DecodedVideo", "ImageBatch", "MediaOptions",
           "MediaPolicy", "PreparedMedia", "ProcessorConfig", "VideoBatch", "VisionSettings", "load_image",
           "load_images", "load_processor_config", "load_video", "load_video_frames", "media_pieces",
           "parse_media_kwargs", "prepare_media", "preprocess_images", "preprocess_videos", "read_source",
           "token_counts"]
