"""Numbers the whole project shares, each defined once.

``CONTEXT_WINDOW`` is the reference implementation's prompt window in tokens
(docs/design/clef-reference.md §11): the default ``max_length``, the tower's context and the memory
model of ``pick`` all start from it. ``models/`` may import this module (tests/test_layout.py).
"""

CONTEXT_WINDOW = 16384
# The vision cache's default budget in MiB (``clef_gguf.vision.cache``), here so that the load settings
# name it without importing torch: one Clef-Flash 448x448 picture is 196 tokens x 4096 floats (~3 MiB),
# so about 80 such pictures.
VISION_CACHE_MB = 256
