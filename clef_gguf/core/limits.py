"""Numbers the whole project shares, each defined once.

``CONTEXT_WINDOW`` is the reference implementation's prompt window in tokens
(docs/design/clef-reference.md §11): the default ``max_length``, the tower's context and the memory
model of ``pick`` all start from it. ``models/`` may import this module (tests/test_layout.py).
"""

from typing import Literal, get_args

CONTEXT_WINDOW = 16384
# Binary byte units, for budgets and messages.
MiB = 1 << 20
GiB = 1 << 30
# A size in MiB (a cache budget flag or setting) is under this: a bound that also refuses inf and nan.
MAX_MB = 1 << 30
# The vision cache's default budget in MiB (``clef_gguf.vision.cache``), here so that the load settings
# name it without importing torch: one Clef-Flash 448x448 picture is 196 tokens x 4096 floats (~3 MiB),
# so about 80 such pictures.
VISION_CACHE_MB = 256
# How the vision tower's arithmetic runs (``clef_gguf.vision.engines``, one implementation per name), here
# so that the load settings name them without importing torch: "exact" is fp32 PyTorch (the reference's
# numerics, the default), "int8" the blocks' Linear layers in dynamic int8 (faster on a CPU, not exact).
VisionEngine = Literal["exact", "int8"]
VISION_ENGINES: tuple[str, ...] = get_args(VisionEngine)
# Tokens of the release's system prefix (clef-reference.md section 7): decoded once per process and
# restored after, so a steady-state decision of N prompt tokens decodes N - 36 (bench's synthetic
# prompts and pick's speed probe use it).
SYSTEM_PREFIX_TOKENS = 36
# Tokens per llama_decode call of one sequence (the tower's n_batch = n_ubatch): a longer segment of a
# prompt is decoded in chunks of this many. pick's speed probe counts a decision's calls with it.
DECODE_CHUNK = 512
# The largest |dp| between two GPU runs of the same answers (another kernel, packed decodes): the GPU's
# sums run in other orders, which the CPU's byte-identity never allows (tune's bar, bench-server's check).
GPU_MAX_DP = 1e-4
