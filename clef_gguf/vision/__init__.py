"""The Qwen3.5 vision tower in PyTorch: images and videos to language-model embeddings.

``model`` is the math, ``load`` reads and checks the config and weights (a converted directory or a release),
``encoder`` holds a loaded tower (``VisionTower.load(...).embed(pixel_values, grid_thw)``), ``cache`` keeps its
outputs for pixels seen before (``CachedVision``).
"""

from clef_gguf.vision.cache import CachedVision, VisionCache
from clef_gguf.vision.encoder import VisionTower
from clef_gguf.vision.load import VISION_CONFIG, VISION_WEIGHTS
from clef_gguf.vision.model import VisionConfig, VisionModel

__all__ = ["VISION_CONFIG", "VISION_WEIGHTS", "CachedVision", "VisionCache", "VisionConfig", "VisionModel",
           "VisionTower"]
