"""The NVFP4 checkpoints in the placement policy: native FP4 on Blackwell, the dequantizing fallback on
other CUDA GPUs, not suitable without one."""

from __future__ import annotations

import pytest

from machine_helpers import B200, H200, RTX5060_8GB, RTX5090, X86, box
from clef_gguf.models import Catalog
from clef_gguf.core.limits import GiB
from clef_gguf.models.machine import GPU, DeviceProfile
from clef_gguf.models.placement import recommend


@pytest.fixture(scope="module")
def cat():
    return Catalog.load()


def nvfp4(rec, quant="NVFP4A16"):
    return {c.quant: c for c in rec.nvfp4}[quant]


def state_bytes(family, ctx=16384):
    m = family.memory
    return m.head_bytes + m.kv_bytes_per_token * ctx + m.recurrent_bytes_per_sequence + m.compute_bytes


@pytest.mark.parametrize("gpu", [RTX5090, B200])
def test_blackwell_runs_w4a4_natively(cat, gpu):
    flash = cat.family("clef-flash")
    rec = recommend(box(gpu), flash)
    assert [c.quant for c in rec.nvfp4] == ["NVFP4A16", "NVFP4"]
    c = nvfp4(rec, "NVFP4")
    ck = flash.tower_source("NVFP4").checkpoint
    assert (c.mode, c.gpu, c.fits, c.suitable) == ("native", 0, True, True)
    assert c.need_bytes == ck.quantized_weights_bytes + ck.bf16_weights_bytes + state_bytes(flash)
    assert 6 * GiB < c.need_bytes < 8 * GiB  # 4 GiB packed (card) + 1.9 GiB bf16 embeddings + state
    assert f"native FP4 (Blackwell, compute capability {gpu.compute_capability})" in c.reason
    assert f"needs {c.need_bytes / GiB:.2f} GiB of GPU memory" in c.reason and "fits" in c.reason
    # W4A16 has no FP4 GEMM (bf16 activations): the backend dequantizes layer by layer even here
    w4a16 = nvfp4(rec)
    assert (w4a16.mode, w4a16.fits) == ("fallback", True)
    assert w4a16.need_bytes == c.need_bytes + ck.dequant_scratch_bytes
    assert "W4A16 has no FP4 GEMM" in w4a16.reason and "native FP4 (Blackwell" in w4a16.reason
    # the GGUF choice is what it was: NVFP4 is never a candidate for it
    assert rec.quant in flash.quants() and {c.quant for c in rec.candidates} == set(flash.quants())


def test_hopper_gets_the_dequantizing_fallback_with_its_memory_need(cat):
    flash = cat.family("clef-flash")
    rec = recommend(box(H200, ram=256), flash)
    ck = flash.tower_source("NVFP4A16").checkpoint
    for c in rec.nvfp4:
        assert (c.mode, c.gpu, c.fits, c.suitable) == ("fallback", 0, True, True)
        assert c.need_bytes == (ck.quantized_weights_bytes + ck.bf16_weights_bytes + ck.dequant_scratch_bytes
                                + state_bytes(flash))  # packed weights stay packed: no dense copy
        assert "dequantizing fallback (no FP4 tensor cores: NVIDIA H200, cc 9.0), layer by layer" in c.reason
        assert f"needs {c.need_bytes / GiB:.2f} GiB of GPU memory" in c.reason and "one dequantized layer" in c.reason
    assert "activations fake-quantized" in nvfp4(rec, "NVFP4").reason
    big = nvfp4(recommend(box(H200, ram=256), "clef", catalog=cat), "NVFP4")
    assert big.name == "clef:NVFP4" and big.mode == "fallback" and big.fits and big.size_bytes is None


def test_a_small_blackwell_gpu_is_native_but_too_small(cat):
    c = nvfp4(recommend(box(RTX5060_8GB, ram=32), "clef-flash", catalog=cat), "NVFP4")
    assert (c.mode, c.fits, c.suitable) == ("native", False, False)
    assert "does not fit" in c.reason and "native FP4" in c.reason


@pytest.mark.parametrize("profile", [
    DeviceProfile(64 * GiB, 60 * GiB, 16, "x86_64", X86),  # no GPU
    DeviceProfile(16 * GiB, 12 * GiB, 10, "arm64", frozenset({"neon"}),
                  (GPU(0, "Apple silicon GPU (Metal, unified memory)", 16 * GiB, 12 * GiB),), True,
                  backends=("Metal",), unified_memory=True),  # a GPU, but not CUDA
])
def test_without_a_cuda_gpu_nvfp4_is_listed_as_not_suitable(cat, profile):
    rec = recommend(profile, "clef-flash", catalog=cat)
    assert rec.nvfp4 and rec.ok
    for c in rec.nvfp4:
        assert (c.mode, c.gpu, c.suitable) == ("cpu", None, False)
        assert "not suitable here: no CUDA GPU" in c.reason and "slow" in c.reason


def test_an_unreported_compute_capability_is_budgeted_as_the_fallback(cat):
    c = nvfp4(recommend(box(GPU(0, "NVIDIA GeForce RTX 4090", 24 * GiB, 23 * GiB)), "clef-flash", catalog=cat))
    assert c.mode == "fallback" and "compute capability not reported" in c.reason


def test_the_gpu_that_runs_it_best_is_chosen(cat):
    h200 = GPU(0, "NVIDIA H200", 140 * GiB, 139 * GiB, "9.0")
    blackwell = GPU(1, "NVIDIA RTX PRO 6000 Blackwell", 96 * GiB, 95 * GiB, "12.0")
    c = nvfp4(recommend(box(h200, blackwell, ram=256), "clef-flash", catalog=cat), "NVFP4")
    assert (c.gpu, c.mode) == (1, "native")
    # a CUDA-only llama.cpp concern does not matter to PyTorch: a CPU-only llama.cpp build still lists it
    cpu_build = DeviceProfile(**{**box(RTX5090).__dict__, "gpu_offload": False})
    assert nvfp4(recommend(cpu_build, "clef-flash", catalog=cat)).suitable
