"""Numbers the whole project shares, each defined once.

``CONTEXT_WINDOW`` is the reference implementation's prompt window in tokens
(docs/design/clef-reference.md §11): the default ``max_length``, the tower's context and the memory
model of ``pick`` all start from it. ``models/`` may import this module (tests/test_layout.py).
"""

from typing import Literal, get_args

CONTEXT_WINDOW = 16384
# Byte units: every byte size outside this module is written with them (tests/test_layout.py holds it).
# Binary ones for budgets, buffers and memory; GB decimal, as model cards and the Hub print file sizes.
KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 10**9
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
# The GPU check's bars (scripts/gpu_check, docs/gpu.md), each defined here once.
# GPU vs CPU answers of the tiny f32 model: the goal, reported. f32 weights on both sides, so only the
# order of the GPU's sums differs, which moves a probability by about this much (1.38e-5 on an H200).
GPU_PARITY_GOAL = 1e-5
# GPU vs CPU answers of the tiny f32 model: past this (or with an argmax that changes) the check fails.
# Two orders of magnitude over what reordered sums give: a wrong kernel or placement moves answers by more.
GPU_PARITY_FAIL = 1e-3
# The nvfp4 backend in fp32, GPU vs CPU, the same reference code on both sides (NVFP4A16: fp32
# activations): the same fp32 math, so only the order of its sums differs, as for GPU_PARITY_GOAL.
NVFP4_FP32_MAX_DP = 1e-5
# The nvfp4 backend in fp32 on the GPU through flash-linear-attention's Triton kernels, against the CPU's
# reference code: another computation (its fp32 dot products may run in TF32), still a small |dp|.
NVFP4_FLA_FP32_MAX_DP = 1e-3
# W4A4 (NVFP4) in fp32, GPU vs CPU: its activations are rounded to FP4 codes, and a code flips where the two
# sides' fp32 sums differ in their last bits (1.2e-3 measured on an H200): a few times that.
NVFP4_W4A4_FP32_MAX_DP = 5e-3
# The nvfp4 backend in bf16 against transformers' own model in bf16 on the same dequantized weights: the
# same layers, so only the order of bf16 sums may differ (kernels chosen by shape); a wrong kernel or
# wiring moves answers by far more.
NVFP4_BF16_MAX_DP = 1e-2
# An NVFP4 GGUF (llama.cpp) against the PyTorch NVFP4 backend on the same checkpoint: the target, reported,
# not asserted (llama.cpp quantizes the activations its own way; the tiny model misses it).
NVFP4_GGUF_TARGET_DP = 1e-2
# The GPU work's performance targets, reported beside what the GPU check measures, never asserted: the
# head under 2 ms and the tower within 25 ms for a ~466-token decision at Clef-Flash's 9B shape, 60
# decisions/s for 64 concurrent clients, and pick's prediction within 25% of a measured decision.
GPU_TARGETS: dict[str, float | tuple[float, float]] = {
    "head_ms": 2.0, "tower_ms_466": 25.0, "decisions_per_s_64": 60.0,
    "pick_ratio": (0.75, 1.25)}
