"""The machine probe: RAM, CPU features, GPUs and llama.cpp's GPU support, as a ``DeviceProfile``.

``probe()`` reads RAM (psutil), CPU features (/proc/cpuinfo, else the platform), NVIDIA GPUs
(``nvidia-smi``) and what the installed llama.cpp can offload to. Everything that does I/O to learn
about the machine lives here; the placement policy (``placement``) only reads the profile, which is
what lets the tests pin it on synthetic machines (8 GB laptop, Raspberry Pi, 24 GB GPU box, ...).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from clef_gguf.core.limits import MiB

# Compute capability majors with FP4 tensor cores (docs/design/nvfp4.md §3): sm_100/103 (B200, B300,
# GB200/GB300), sm_110 (Jetson Thor), sm_120/121 (RTX 50xx, RTX PRO Blackwell, DGX Spark). Hopper (9.0)
# and older have no FP4 MMA, so the nvfp4 backend dequantizes there (section 4).
NATIVE_FP4_MAJORS = frozenset({10, 11, 12})
GPU_QUERY = "index,name,memory.total,memory.free"


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    vram_total: int
    vram_free: int | None = None
    compute_capability: str | None = None  # "12.0" (nvidia-smi compute_cap); None: not reported


@dataclass(frozen=True)
class DeviceProfile:
    total_ram: int
    available_ram: int
    cpu_count: int = 1
    arch: str = ""
    cpu_flags: frozenset[str] = frozenset()
    gpus: tuple[GPU, ...] = ()
    # Whether the installed llama.cpp can offload to a GPU; None = unknown (llama_cpp not importable).
    gpu_offload: bool | None = None
    label: str = ""
    backends: tuple[str, ...] = ()  # GPU backends compiled into llama.cpp: CUDA, Metal, Vulkan...
    unified_memory: bool = False  # Apple silicon: the GPU works in the same RAM as the CPU

    @property
    def avx2(self) -> bool:
        return "avx2" in self.cpu_flags

    @property
    def avx512(self) -> bool:
        return any(f.startswith("avx512") for f in self.cpu_flags)

    @property
    def neon(self) -> bool:
        return bool({"neon", "asimd"} & self.cpu_flags)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu_flags"] = sorted(self.cpu_flags)
        d["features"] = {"avx2": self.avx2, "avx512": self.avx512, "neon": self.neon}
        return d


def native_fp4(gpu: GPU) -> bool | None:
    """True: the GPU has FP4 tensor cores (Blackwell); False: it has none; None: compute capability
    not reported (an old driver), so nobody can tell."""
    try:
        return int(str(gpu.compute_capability).split(".")[0]) in NATIVE_FP4_MAJORS
    except ValueError:
        return None


def probe(*, check_llama: bool = True) -> DeviceProfile:
    """This machine's RAM, CPU features, NVIDIA GPUs and llama.cpp GPU offload support."""
    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    apple = platform.system() == "Darwin" and platform.machine().lower() in ("arm64", "aarch64")
    gpus = (GPU(0, "Apple silicon GPU (Metal, unified memory)", total, available),) if apple \
        else _nvidia_gpus()
    return DeviceProfile(total_ram=total, available_ram=available, cpu_count=os.cpu_count() or 1,
                         arch=platform.machine(), cpu_flags=_cpu_flags(), gpus=gpus,
                         gpu_offload=_llama_gpu_offload() if check_llama else None,
                         label=platform.node() or "this machine",
                         backends=llama_backends() if check_llama else (),
                         unified_memory=apple)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, else the platform)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint() -> dict[str, Any]:
    """What a measurement on this machine depends on: the CPU, its cores and the llama.cpp build
    (version and system info). A kept measurement whose fingerprint differs is measured again."""
    import llama_cpp

    return {"cpu": cpu_model(), "arch": platform.machine(), "cores": os.cpu_count(),
            "llama_cpp": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace")}


def _cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):  # x86 / ARM spelling
                flags = set(value.split())
                if "asimd" in flags:
                    flags.add("neon")  # AArch64 reports NEON as Advanced SIMD
                return frozenset(flags)
    except OSError:
        pass
    # macOS and others: every AArch64 CPU has NEON; nothing is claimed for x86 without /proc.
    return frozenset({"neon"}) if platform.machine().lower() in ("arm64", "aarch64") else frozenset()


def _nvidia_gpus() -> tuple[GPU, ...]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return ()
    out = None
    # compute_cap (whether the GPU has FP4 tensor cores) is a newer field: a driver that does not
    # know it rejects the whole query, so ask again without it rather than lose the GPUs.
    for query in (GPU_QUERY + ",compute_cap", GPU_QUERY):
        try:
            out = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
            break
        except (OSError, subprocess.SubprocessError):
            continue
    if out is None:
        return ()
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            cc = parts[4] if len(parts) > 4 and parts[4] not in ("", "[N/A]") else None
            gpus.append(GPU(int(parts[0]), parts[1], int(float(parts[2])) * MiB,
                            int(float(parts[3])) * MiB if parts[3] not in ("", "[N/A]") else None, cc))
        except (IndexError, ValueError):
            continue  # MIG or odd drivers print [N/A]; skip rather than guess
    return tuple(gpus)


def llama_backends() -> tuple[str, ...]:
    """The GPU backends of the installed llama.cpp build, from its system info line
    (``CPU : AVX2 = 1 | ... | CUDA : ARCHS = 890 | ...``)."""
    try:
        import llama_cpp
        info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    except Exception:
        return ()
    names = [seg.split(" : ")[0].strip() for seg in info.split("|") if " : " in seg]
    return tuple(n for n in names if n and n.upper() != "CPU")


def _llama_gpu_offload() -> bool | None:
    try:
        import llama_cpp
        return bool(llama_cpp.llama_supports_gpu_offload())
    except Exception:
        return None
