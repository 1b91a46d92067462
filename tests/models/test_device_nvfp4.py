"""`pick` and the NVFP4 checkpoints: native FP4 on Blackwell, the dequantizing fallback on other CUDA
GPUs, not suitable without one; the GPU's compute capability from (a fake) nvidia-smi."""

from __future__ import annotations

import argparse
import json

import pytest

from clef_gguf.models import Catalog, device
from clef_gguf.models.device import GPU, GiB, MiB, DeviceProfile, recommend

X86 = frozenset({"avx2", "fma"})


def box(*gpus: GPU, ram: int = 64) -> DeviceProfile:
    return DeviceProfile(ram * GiB, (ram - 8) * GiB, 16, "x86_64", X86, gpus, True)


RTX5090 = GPU(0, "NVIDIA GeForce RTX 5090", 32 * GiB, 31 * GiB, "12.0")
B200 = GPU(0, "NVIDIA B200", 180 * GiB, 179 * GiB, "10.0")
H200 = GPU(0, "NVIDIA H200", 140 * GiB, 139 * GiB, "9.0")
RTX5060_8GB = GPU(0, "NVIDIA GeForce RTX 5060", 8 * GiB, 6 * GiB, "12.0")  # 2 GiB in use elsewhere


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


def test_native_fp4_by_compute_capability():
    cc = {"8.9": False, "9.0": False, "10.0": True, "10.3": True, "11.0": True, "12.0": True, "12.1": True,
          None: None, "[N/A]": None}
    for value, expected in cc.items():
        assert device.native_fp4(GPU(0, "x", GiB, None, value)) is expected, value


def fake_smi(tmp_path, monkeypatch, script: str):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + script)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def test_nvidia_smi_compute_capability_is_read(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, 'case "$1" in *compute_cap*) '
             "printf '0, NVIDIA H200, 143771, 143000, 9.0\\n1, NVIDIA GeForce RTX 5090, 32607, [N/A], 12.0\\n';; "
             "*) exit 9;; esac\n")
    h200, rtx = device._nvidia_gpus()
    assert (h200.name, h200.vram_total, h200.compute_capability) == ("NVIDIA H200", 143771 * MiB, "9.0")
    assert (rtx.vram_free, rtx.compute_capability) == (None, "12.0")
    assert device.native_fp4(rtx) and device.native_fp4(h200) is False


def test_a_driver_without_compute_cap_still_reports_its_gpus(tmp_path, monkeypatch):
    # Old nvidia-smi: an unknown field fails the whole query (exit 2); the GPUs must not be lost.
    fake_smi(tmp_path, monkeypatch, 'case "$1" in *compute_cap*) echo "Field \\"compute_cap\\" is not a valid '
             "field to query.\" >&2; exit 2;; *) printf '0, Tesla V100-SXM2-16GB, 16160, 16000\\n';; esac\n")
    [v100] = device._nvidia_gpus()
    assert (v100.name, v100.vram_total, v100.compute_capability) == ("Tesla V100-SXM2-16GB", 16160 * MiB, None)


@pytest.mark.parametrize("gpu, words", [
    (RTX5090, "native FP4 (Blackwell, compute capability 12.0)"),
    (H200, "dequantizing fallback (no FP4 tensor cores: NVIDIA H200, cc 9.0)"),
])
def test_pick_says_whether_the_gpu_has_native_fp4(monkeypatch, capsys, gpu, words):
    monkeypatch.setattr(device, "probe", lambda **_: box(gpu, ram=256))
    parser = argparse.ArgumentParser()
    device.add_arguments(parser)
    assert "clef-flash:nvfp4a16" in parser.format_help() and "Blackwell" in parser.format_help()
    assert device.run(parser.parse_args([])) == 0
    out = capsys.readouterr().out
    gpu_line = next(line for line in out.splitlines() if line.startswith("GPU:"))
    assert f"NVFP4: {words}" in gpu_line
    assert "NVFP4 checkpoints (nvfp4 backend; pulled by name, never chosen automatically):" in out
    assert f"+ clef-flash:NVFP4 (W4A4, by name only) fits: {words}" in out
    assert "+ clef-flash:NVFP4A16 (W4A16, by name only) fits: dequantizing fallback" in out
    assert device.run(parser.parse_args(["--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"]["gpus"][0]["compute_capability"] == gpu.compute_capability
    rows = {r["quant"]: r for r in data["recommendation"]["nvfp4"]}
    assert set(rows) == {"NVFP4A16", "NVFP4"} and rows["NVFP4A16"]["need_bytes"] > 7 * GiB
    assert rows["NVFP4"]["mode"] == ("native" if gpu is RTX5090 else "fallback")
    assert rows["NVFP4A16"]["mode"] == "fallback"
    assert data["recommendation"]["name"].split(":")[1] not in rows  # auto stays GGUF


def test_pick_without_a_gpu_lists_nvfp4_as_not_suitable(monkeypatch, capsys):
    monkeypatch.setattr(device, "probe", lambda **_: DeviceProfile(32 * GiB, 26 * GiB, 16, "x86_64", X86))
    parser = argparse.ArgumentParser()
    device.add_arguments(parser)
    assert device.run(parser.parse_args([])) == 0
    out = capsys.readouterr().out
    assert "GPU:  none" in out and "- clef-flash:NVFP4A16 (W4A16) is not suitable here: no CUDA GPU" in out
