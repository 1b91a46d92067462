"""The machine probe: this machine, and (fake) nvidia-smi, /proc/cpuinfo and llama.cpp outputs."""

from __future__ import annotations

import json

from clef_gguf.models import machine
from clef_gguf.core.limits import GiB, MiB
from clef_gguf.models.machine import GPU, DeviceProfile


def test_probe_on_this_machine_is_sane():
    p = machine.probe()
    assert p.total_ram > 256 * 1024 * 1024 and 0 < p.available_ram <= p.total_ram
    assert p.cpu_count >= 1 and p.arch
    assert p.gpu_offload in (True, False, None)
    for g in p.gpus:
        assert g.vram_total > 0
    json.dumps(p.to_dict())


def test_nvidia_smi_output_is_parsed(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0, NVIDIA H200, 143771, 143000\\n1, Tesla T4, 15360, [N/A]\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    h200, t4 = machine._nvidia_gpus()
    assert (h200.index, h200.name, h200.vram_total, h200.vram_free) == (0, "NVIDIA H200", 143771 << 20, 143000 << 20)
    assert (t4.name, t4.vram_total, t4.vram_free) == ("Tesla T4", 15360 << 20, None)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert machine._nvidia_gpus() == ()


def test_cpu_flags_from_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm crc32 cpuid\n")
    assert {"avx2", "avx512f"} <= machine._cpu_flags(x86)
    arm_profile = DeviceProfile(8 * GiB, 6 * GiB, 4, "aarch64", machine._cpu_flags(arm))
    assert arm_profile.neon and not arm_profile.avx2


def test_backends_come_from_llama_cpps_system_info(monkeypatch):
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: (
        b"CPU : SSE3 = 1 | AVX2 = 1 | CUDA : ARCHS = 890 | USE_GRAPHS = 1 | Metal : EMBED = 1 | "))
    assert machine.llama_backends() == ("CUDA", "Metal")
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX2 = 1 | ")
    assert machine.llama_backends() == ()


def test_native_fp4_by_compute_capability():
    cc = {"8.9": False, "9.0": False, "10.0": True, "10.3": True, "11.0": True, "12.0": True, "12.1": True,
          None: None, "[N/A]": None}
    for value, expected in cc.items():
        assert machine.native_fp4(GPU(0, "x", GiB, None, value)) is expected, value


def fake_smi(tmp_path, monkeypatch, script: str):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + script)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def test_nvidia_smi_compute_capability_is_read(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, 'case "$1" in *compute_cap*) '
             "printf '0, NVIDIA H200, 143771, 143000, 9.0\\n1, NVIDIA GeForce RTX 5090, 32607, [N/A], 12.0\\n';; "
             "*) exit 9;; esac\n")
    h200, rtx = machine._nvidia_gpus()
    assert (h200.name, h200.vram_total, h200.compute_capability) == ("NVIDIA H200", 143771 * MiB, "9.0")
    assert (rtx.vram_free, rtx.compute_capability) == (None, "12.0")
    assert machine.native_fp4(rtx) and machine.native_fp4(h200) is False


def test_a_driver_without_compute_cap_still_reports_its_gpus(tmp_path, monkeypatch):
    # Old nvidia-smi: an unknown field fails the whole query (exit 2); the GPUs must not be lost.
    fake_smi(tmp_path, monkeypatch, 'case "$1" in *compute_cap*) echo "Field \\"compute_cap\\" is not a valid '
             "field to query.\" >&2; exit 2;; *) printf '0, Tesla V100-SXM2-16GB, 16160, 16000\\n';; esac\n")
    [v100] = machine._nvidia_gpus()
    assert (v100.name, v100.vram_total, v100.compute_capability) == ("Tesla V100-SXM2-16GB", 16160 * MiB, None)
