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


class MachineLoad:
    """``core.load.Meter`` replaced by this fake (the ``machine_load`` fixture): every window reports
    ``contended`` cores of other processes' work on the measured cores, whatever the machine does."""

    def __init__(self) -> None:
        self.contended = 0.0
        self.laps = 0

    def busy(self, cores: float = 2.0) -> None:
        self.contended = cores

    def quiet(self) -> None:
        self.contended = 0.0

    def meter(self, threads: int, pid: int | None = None) -> "FakeMeter":
        return FakeMeter(self)


class FakeMeter:
    def __init__(self, machine: MachineLoad) -> None:
        self.machine = machine

    def lap(self):
        from clef_gguf.core.load import Window

        self.machine.laps += 1
        c = self.machine.contended
        return Window(1.0, c, c, 1.0)
