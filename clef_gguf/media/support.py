"""What a loaded model can do with images and videos: its release's processor settings, its vision
tower (loaded on the first picture that needs it: the 9B's is ~0.4B parameters, text-only users never
pay for it), and the sources a request may name by default (any path or URL, as the reference reads
them; the server passes a stricter ``MediaPolicy``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from clef_gguf.media.config import ProcessorConfig, load_processor_config
from clef_gguf.media.sources import MediaPolicy

if TYPE_CHECKING:
    from clef_gguf.pipeline.encode import Encoder
    from clef_gguf.formats.files import ModelFiles
    from clef_gguf.media.prompt import MediaTokens
    from clef_gguf.pipeline.request import Request
    from clef_gguf.vision.cache import CachedVision, VisionCache
    from clef_gguf.vision.encoder import VisionTower

# The Python API's and the CLI's sources: local paths (relative to the working directory) and URLs.
ANY_SOURCE = MediaPolicy(local_paths=True, url_allow=("*",))


def _unknown(_path: Path) -> str | None:
    return None


@dataclass
class MediaSupport:
    processor: ProcessorConfig | None
    vision_dir: Path | None  # a directory with the vision tower's files
    why_not: str  # what is missing, when the model cannot see
    threads: int | None = None
    cache: VisionCache | None = None  # the vision tower's outputs for pixels seen before (None: none kept)
    known_sha256: Callable[[Path], str | None] = _unknown  # the model's recorded hashes (the cache keys)
    engine: str = "exact"  # how the vision tower runs (--vision-engine: clef_gguf.vision.engines)
    _tower: VisionTower | None = field(default=None, repr=False)
    _cached: CachedVision | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def none(cls, why: str = "this model has no vision tower") -> MediaSupport:
        return cls(None, None, why)

    @classmethod
    def of(cls, found: ModelFiles, backend: str, *, threads: int | None = None,
           cache: VisionCache | None = None, engine: str = "exact") -> MediaSupport:
        """The media support of a model: a vision tower (``vision_config.json`` + ``vision.safetensors``,
        written by ``convert`` beside the tower or by ``pull`` into ``found.vision``) and processor settings;
        ``cache``: where its outputs are kept for pixels seen again; ``engine``: how the tower runs."""
        from clef_gguf.formats.files import VISION_CONFIG

        if backend == "nvfp4":  # a checkpoint keeps the release's vision tensors as stored
            from clef_gguf.vision.load import release_config

            directory = found.tower.parent
            if release_config(directory) is None:
                return cls.none(f"{directory / 'config.json'} has no vision_config")
        else:
            directory = found.vision or found.tower.parent
            if not (directory / VISION_CONFIG).is_file():
                return cls.none(f"{directory} has no vision tower ({VISION_CONFIG}); convert the release "
                                "again, or pull the model again, with this version")
        processor = load_processor_config(directory)
        if processor is None:
            return cls.none(f"{directory} has no processor settings (preprocessor_config.json)")
        return cls(processor, directory, "", threads, cache, found.known_sha256, engine)

    @property
    def available(self) -> bool:
        return self.processor is not None and self.vision_dir is not None

    def describe(self) -> str:
        return "images, videos" if self.available else f"none ({self.why_not})"

    def vision(self) -> VisionTower:
        """The vision tower, loaded once (thread-safe)."""
        from clef_gguf.vision.encoder import VisionTower

        assert self.vision_dir is not None
        with self._lock:
            if self._tower is None:
                self._tower = VisionTower.load(self.vision_dir, threads=self.threads, engine=self.engine)
            return self._tower

    def cached_vision(self) -> CachedVision:
        """The vision tower behind the cache (a cache of 0 bytes when none was given), made once."""
        from clef_gguf.vision.cache import CachedVision, VisionCache, weights_identity

        tower = self.vision()
        with self._lock:
            if self._cached is None:
                cache = self.cache if self.cache is not None else VisionCache(0)
                self._cached = CachedVision(tower, cache, weights_identity(tower.files, self.known_sha256))
            return self._cached

    def tokens(self, request: Request, encoder: Encoder, policy: MediaPolicy | None) -> MediaTokens:
        """The media of ``request`` (refused, naming the field, when this model cannot see)."""
        from clef_gguf.media.prompt import media_tokens, unsupported

        if not self.available or self.processor is None:
            raise unsupported(request, self.why_not)
        return media_tokens(request, self.processor, ANY_SOURCE if policy is None else policy, encoder,
                            self.cached_vision)


def warnings(media: MediaTokens) -> tuple[dict, ...]:
    """The ``media_kwargs`` keys the processor ignores, as the response's warnings."""
    fields = (text.split(" ", 1)[0] for text in media.warnings)
    return tuple({"code": "ignored_field", "field": name,
                  "message": f"'{name}' was ignored: the image and video processors do not take it"}
                 for name in fields)
