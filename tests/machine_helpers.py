"""Synthetic CUDA machines for the NVFP4 placement and ``pick`` tests."""

from __future__ import annotations

from clef_gguf.core.limits import GiB
from clef_gguf.models.machine import GPU, DeviceProfile

X86 = frozenset({"avx2", "fma"})


def box(*gpus: GPU, ram: int = 64) -> DeviceProfile:
    return DeviceProfile(ram * GiB, (ram - 8) * GiB, 16, "x86_64", X86, gpus, True)


RTX5090 = GPU(0, "NVIDIA GeForce RTX 5090", 32 * GiB, 31 * GiB, "12.0")
B200 = GPU(0, "NVIDIA B200", 180 * GiB, 179 * GiB, "10.0")
H200 = GPU(0, "NVIDIA H200", 140 * GiB, 139 * GiB, "9.0")
RTX5060_8GB = GPU(0, "NVIDIA GeForce RTX 5060", 8 * GiB, 6 * GiB, "12.0")  # 2 GiB in use elsewhere
