"""What the vision tower can reuse: its output for pixels it has embedded before, under a byte budget.

The state cache (``clef_gguf.tower.cache``) helps only when a request's state and pictures both repeat:
its keys are the ``[prefix][pictures][state]`` token ids and the pixels' digest. Another state about
the same picture (or the same one after its entry was evicted) decodes that segment again, and its pad
tokens need the picture's embeddings: this cache holds them, so the vision tower runs once per picture
however many requests ask about it.

A key names everything the output depends on: the processed pixel values and their grids (t, h, w),
the engine that ran (``exact``, ``int8``: their outputs differ) and its dtype, and the vision weights'
identity. An entry is the tower's output itself, so a hit gives the very rows a run would (answers
byte-identical to a cold process's). The unit is one ``VisionTower.embed`` call (a request's images,
or its videos), as the tower is called: embedding each picture alone could round differently in the
last bits from embedding them together.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from clef_gguf.core.limits import MiB
from clef_gguf.core.limits import VISION_CACHE_MB as DEFAULT_MB
from clef_gguf.core.lru import ByteLRU
from clef_gguf.vision.encoder import VisionTower

def weights_identity(files: Iterable[Path], known_sha256: Callable[[Path], str | None]) -> str:
    """The vision weights' part of every key: each file's sha256 where the model's manifest recorded
    it (``ModelFiles.known_sha256``; ``convert`` records ``vision.safetensors``), else its real path,
    size and modification time. Hashing ~0.9 GB at load to key an in-memory cache would cost more than
    it guards: the cache lives and dies with the process that loaded the tower."""
    parts = []
    for path in sorted(Path(p).resolve() for p in files):
        known = known_sha256(path)
        if known is not None:
            parts.append(f"sha256:{known}")
        else:
            st = path.stat()
            parts.append(f"file:{path}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class VisionCache(ByteLRU[torch.Tensor]):
    """A byte-bounded LRU of vision outputs (float32 [tokens, out_hidden_size]); ``max_bytes=0``
    keeps nothing (the tower runs for every picture). Thread-safe: a server's requests share it."""

    def __init__(self, max_bytes: int = DEFAULT_MB * MiB) -> None:
        super().__init__(max_bytes, lambda rows: rows.nelement() * rows.element_size())


def pixels_digest(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> bytes:
    """sha256 of a batch's processed pixels and grid, with their dtypes and shapes: equal digests,
    equal input to the vision tower. Hashed in place (no copy of the pixels)."""
    digest = hashlib.sha256()
    grids = np.ascontiguousarray(torch.as_tensor(grid_thw).numpy(), dtype="<i8")
    pixels = np.ascontiguousarray(torch.as_tensor(pixel_values).contiguous().numpy())
    digest.update(f"{list(grids.shape)}:{pixels.dtype}:{list(pixels.shape)}:".encode())
    digest.update(grids.data)
    digest.update(pixels.data)
    return digest.digest()


@dataclass(frozen=True)
class Embedding:
    """One ``embed`` call's output, and whether the cache held it (the tower did not run)."""

    rows: torch.Tensor  # float32 [tokens, out_hidden_size]; a cached entry: never written to
    cached: bool

    @property
    def cached_tokens(self) -> int:
        return len(self.rows) if self.cached else 0


class CachedVision:
    """A loaded vision tower behind its cache: ``embed`` as ``VisionTower.embed``, the tower run only
    for pixels the cache does not hold."""

    def __init__(self, tower: VisionTower, cache: VisionCache, weights: str) -> None:
        """``weights``: the tower's ``weights_identity``."""
        self.tower, self.cache = tower, cache
        self._tag = f"{tower.engine}:{tower.dtype}:{weights}:".encode()

    def key(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, hashed: bytes | None = None) -> bytes:
        """``hashed``: ``pixels_digest(pixel_values, grid_thw)`` when the caller has it already (the
        prepare stage hashes every batch once), so the model's thread does not hash them again."""
        return hashlib.sha256(self._tag + (hashed or pixels_digest(pixel_values, grid_thw))).digest()

    def embed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
              hashed: bytes | None = None) -> Embedding:
        if self.cache.max_bytes == 0:  # off: not even the pixels' hash
            return Embedding(self.tower.embed(pixel_values, grid_thw), cached=False)
        key = self.key(pixel_values, grid_thw, hashed)
        found = self.cache.get(key)
        if found is not None:
            return Embedding(found, cached=True)
        rows = self.tower.embed(pixel_values, grid_thw)
        self.cache.put(key, rows)
        return Embedding(rows, cached=False)
