"""Device fit: probe this machine, and a pure policy that picks the best quant that fits it.

``probe()`` reads RAM (psutil, else /proc/meminfo), CPU features (/proc/cpuinfo, else the platform)
and NVIDIA GPUs (``nvidia-smi``) into a ``DeviceProfile``. ``recommend(profile, family)`` does no
I/O: given the same profile and catalog it always answers the same, which is what lets the tests
pin the policy on synthetic machines (8 GB laptop, Raspberry Pi, 24 GB GPU box, ...).

Memory model for one decision context (all figures from the catalog's family entry):
  tower file (mmapped, and it must stay resident or every decision pages it back in from disk)
  + KV cache (f16, per token of context) + recurrent state (per sequence)
  + head (bf16) + dequantized lexical rows + llama.cpp compute buffer + Python/torch runtime,
against min(available RAM - headroom, total RAM - a reserve for the OS). On a GPU with enough VRAM the tower,
KV, recurrent state and compute buffer go to VRAM instead and the host keeps the rest.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clef_gguf.argtypes import positive_int
from clef_gguf.errors import ModelLoadError
from clef_gguf.models.catalog import Catalog, Family, load_catalog

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_CONTEXT = 16384  # the reference implementation's window (design/clef-reference.md section 11)
# A size that is only estimated gets a safety margin, so "fits" stays true when the real file arrives.
SIZE_MARGIN = {"exact": 1.0, "card": 1.0, "proxy": 1.03, "estimate": 1.10}
GPU_RESERVE = 512 * MiB  # CUDA context and allocator slack, which never show up as model memory
# Not picked for CPU placement: llama.cpp's CPU path streams every weight per token, so BF16 costs twice
# Q8_0's time for agreement Q8_0 already reaches (max |dp| 0.014 vs the bf16 reference, landscape.md 6).
CPU_SKIP = frozenset({"BF16"})


class NoQuantFits(ModelLoadError):
    """No quant of the family fits this machine's memory (the message says what would)."""

    code = "no_quant_fits"


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    vram_total: int
    vram_free: int | None = None


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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_flags"] = sorted(self.cpu_flags)
        d["features"] = {"avx2": self.avx2, "avx512": self.avx512, "neon": self.neon}
        return d


@dataclass(frozen=True)
class Candidate:
    quant: str
    source: str
    size_bytes: int
    size_basis: str
    need_bytes: int  # total need, all placements together
    fits_cpu: bool
    fits_gpu: bool

    @property
    def fits(self) -> bool:
        return self.fits_cpu or self.fits_gpu


@dataclass(frozen=True)
class Recommendation:
    family: str
    quant: str | None
    source: str | None
    placement: str | None  # "cpu" | "gpu" | None when nothing fits
    context_tokens: int
    budget_bytes: int  # usable host RAM (or VRAM, for placement "gpu")
    need_bytes: int | None
    reason: str
    breakdown: dict[str, int] = field(default_factory=dict)
    candidates: tuple[Candidate, ...] = ()

    @property
    def ok(self) -> bool:
        return self.quant is not None

    @property
    def name(self) -> str | None:
        return f"{self.family}:{self.quant}" if self.quant else None

    def require(self) -> Recommendation:
        if not self.ok:
            raise NoQuantFits(self.reason, field="model")
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"], d["name"] = self.ok, self.name
        for c in d["candidates"]:
            c["fits"] = c["fits_cpu"] or c["fits_gpu"]
        return d


def os_reserve(total_ram: int) -> int:
    """RAM never planned for: 1 GiB or 10 % of the machine, whichever is larger (desktop, caches)."""
    return max(GiB, total_ram // 10)


def free_headroom(total_ram: int) -> int:
    """Part of today's available RAM left unplanned too, so other programs don't push the model to swap."""
    return max(512 * MiB, total_ram // 20)


def host_budget(profile: DeviceProfile) -> int:
    return max(0, min(profile.available_ram - free_headroom(profile.total_ram),
                      profile.total_ram - os_reserve(profile.total_ram)))


def _gb(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def recommend(profile: DeviceProfile, family: Family | str = "clef-flash", *,
              context_tokens: int = DEFAULT_CONTEXT, sequences: int = 1,
              catalog: Catalog | None = None) -> Recommendation:
    """The highest-quality quant of ``family`` that fits ``profile``, with the reason and the candidates.

    Pure: reads nothing but its arguments (and the packaged catalog when ``family`` is a name).
    """
    if isinstance(family, str):
        family = (catalog or load_catalog()).family(family)
    if context_tokens < 1 or sequences < 1:
        raise ValueError("context_tokens and sequences must be positive")
    mem = family.memory
    kv = mem.kv_bytes_per_token * context_tokens
    rec = mem.recurrent_bytes_per_sequence * sequences
    breakdown = {"kv_cache": kv, "recurrent_state": rec, "head": mem.head_bytes,
                 "lexical_rows": mem.lexical_rows_bytes, "compute": mem.compute_bytes,
                 "runtime": mem.runtime_bytes, "os_reserve": os_reserve(profile.total_ram)}
    device_side = kv + rec + mem.compute_bytes  # what moves to VRAM with the tower
    host_side = mem.head_bytes + mem.lexical_rows_bytes + mem.runtime_bytes
    breakdown["free_headroom"] = free_headroom(profile.total_ram)
    host = host_budget(profile)
    gpu, gpu_budget = _gpu_budget(profile)

    candidates = []
    for quant in family.quants():
        source = family.tower_source(quant)
        size, basis = family.tower_size(quant)
        tower = int(size * SIZE_MARGIN[basis])
        fits_cpu, fits_gpu = _fits(profile, tower, device_side, host_side, gpu_budget)
        fits_cpu = fits_cpu and quant not in CPU_SKIP
        candidates.append(Candidate(quant, source.alias, size, basis, tower + device_side + host_side,
                                    fits_cpu, fits_gpu))

    ctx = f"{context_tokens:,} tokens of context"
    # Pinned sources first: a recommendation should be reproducible; unpinned only if nothing else fits.
    pinned = [c for c in candidates if family.source(c.source).pinned]
    chosen = next((c for c in pinned if c.fits), None) or next((c for c in candidates if c.fits), None)
    if chosen is None:
        smallest = min(candidates, key=lambda c: c.need_bytes)
        small_ctx = 2048
        at_small = smallest.need_bytes - kv + mem.kv_bytes_per_token * small_ctx
        hint = (f" With --ctx {small_ctx} it would need {_gb(at_small)}."
                if context_tokens > small_ctx and at_small <= host else "")
        reason = (f"No {family.name} quant fits this machine: the smallest, {smallest.quant} "
                  f"({smallest.size_bytes / 1e9:.2f} GB, {smallest.size_basis} size), needs "
                  f"{_gb(smallest.need_bytes)} at {ctx} but only {_gb(host)} of RAM is usable "
                  f"({_gb(profile.available_ram)} available; {_gb(breakdown['free_headroom'])} of it and "
                  f"{_gb(breakdown['os_reserve'])} of the total kept free)"
                  + (f" and {_gb(gpu_budget)} of VRAM" if gpu_budget else "") + f".{hint}"
                  " Free memory, use a smaller context, or a machine with more memory.")
        return Recommendation(family.name, None, None, None, context_tokens, host, None, reason,
                              breakdown, tuple(candidates))

    placement = "gpu" if chosen.fits_gpu else "cpu"
    budget = gpu_budget if placement == "gpu" else host
    need = chosen.need_bytes - (host_side if placement == "gpu" else 0)
    tower = chosen.need_bytes - device_side - host_side
    parts = (f"tower {_gb(tower)} + KV {_gb(kv)} + recurrent {_gb(rec)} + compute {_gb(mem.compute_bytes)}"
             + ("" if placement == "gpu" else f" + head {_gb(mem.head_bytes)} + lexical rows "
                f"{_gb(mem.lexical_rows_bytes)} + runtime {_gb(mem.runtime_bytes)}"))
    where = (f"{_gb(budget)} of VRAM usable on GPU {gpu.index} ({gpu.name})" if placement == "gpu" else
             f"{_gb(budget)} of RAM usable ({_gb(profile.available_ram)} available; "
             f"{_gb(breakdown['free_headroom'])} of it and {_gb(breakdown['os_reserve'])} of the total kept free)")
    reason = (f"{chosen.quant} from {chosen.source} ({chosen.size_bytes / 1e9:.2f} GB, {chosen.size_basis} size)"
              f" is the best quant that fits: it needs {_gb(need)} at {ctx} ({parts}) of {where}.")
    better = [c for c in candidates[:candidates.index(chosen)] if c.quant not in CPU_SKIP or gpu_budget]
    if better:
        nxt = better[-1]
        reason += f" The next better, {nxt.quant}, needs {_gb(nxt.need_bytes)}."
    if placement == "cpu" and candidates[0].quant in CPU_SKIP and candidates[0].need_bytes <= host:
        reason += " BF16 is not picked for CPU (twice Q8_0's bytes per token for no measured gain)."
    skipped = [c.quant for c in candidates[:candidates.index(chosen)] if c.fits]
    if skipped:
        reason += (f" {', '.join(skipped)} would fit too but only from a source without a pinned "
                   "revision; pull it by name to use it anyway.")
    src = family.source(chosen.source)
    if not src.pinned:
        reason += (f" Note: {src.repo} has no pinned revision in the catalog; pull records the commit"
                   " it gets.")
    if placement == "gpu" and profile.gpu_offload is None:
        reason += " GPU placement needs llama-cpp-python built with CUDA (not checked: llama_cpp not importable)."
    if gpu is not None and profile.gpu_offload is False:
        reason += " A GPU is present but this llama-cpp-python build cannot offload, so RAM was used."
    reason += _cpu_note(profile, placement)
    return Recommendation(family.name, chosen.quant, chosen.source, placement, context_tokens, budget, need,
                          reason, breakdown, tuple(candidates))


def _gpu_budget(profile: DeviceProfile) -> tuple[GPU | None, int]:
    """The roomiest GPU and the bytes usable on it (0 when llama.cpp cannot offload)."""
    gpu = max(profile.gpus, key=lambda g: g.vram_free or g.vram_total, default=None)
    if gpu is None or profile.gpu_offload is False:
        return gpu, 0
    if profile.unified_memory:  # the GPU's memory is the RAM the host budget already counts
        return gpu, host_budget(profile)
    return gpu, max(0, (gpu.vram_free if gpu.vram_free is not None else gpu.vram_total) - GPU_RESERVE)


def _fits(profile: DeviceProfile, tower: int, device_side: int, host_side: int,
          gpu_budget: int) -> tuple[bool, bool]:
    """(fits on the CPU, fits with the tower on the GPU): the one rule behind every placement."""
    host = host_budget(profile)
    fits_cpu = tower + device_side + host_side <= host
    if profile.unified_memory:
        fits_gpu = gpu_budget > 0 and fits_cpu
    else:
        fits_gpu = gpu_budget > 0 and tower + device_side <= gpu_budget and host_side <= host
    return fits_cpu, fits_gpu


def gpu_layers(profile: DeviceProfile, tower_bytes: int, family: Family | str = "clef-flash", *,
               context_tokens: int = DEFAULT_CONTEXT, catalog: Catalog | None = None) -> int:
    """Layers to offload for a tower of ``tower_bytes``: -1 (all) where ``recommend`` would place
    it on the GPU, else 0. The runtime's default, so ``pick``, ``--quant auto`` and a loaded model
    never disagree."""
    if not profile.gpu_offload:
        return 0
    if isinstance(family, str):
        family = (catalog or load_catalog()).family(family)
    mem = family.memory
    device_side = (mem.kv_bytes_per_token * context_tokens + mem.recurrent_bytes_per_sequence
                   + mem.compute_bytes)
    host_side = mem.head_bytes + mem.lexical_rows_bytes + mem.runtime_bytes
    _, budget = _gpu_budget(profile)
    return -1 if _fits(profile, tower_bytes, device_side, host_side, budget)[1] else 0


def _cpu_note(profile: DeviceProfile, placement: str) -> str:
    if placement != "cpu":
        return ""
    machine = profile.arch.lower()
    if machine in ("x86_64", "amd64", "i686") and profile.cpu_flags and not profile.avx2:
        return " This CPU has no AVX2: llama.cpp's quantized kernels will be slow."
    if machine in ("aarch64", "arm64") and profile.neon:
        return " ARM with NEON: Q4_0 gets llama.cpp's repacked ARM kernels and may run faster."
    return ""


# ---------------------------------------------------------------- probe (I/O lives only below)

def probe(*, check_llama: bool = True) -> DeviceProfile:
    """This machine's RAM, CPU features, NVIDIA GPUs and llama.cpp GPU offload support."""
    total, available = _ram()
    apple = platform.system() == "Darwin" and platform.machine().lower() in ("arm64", "aarch64")
    gpus = (GPU(0, "Apple silicon GPU (Metal, unified memory)", total, available),) if apple \
        else _nvidia_gpus()
    return DeviceProfile(total_ram=total, available_ram=available, cpu_count=os.cpu_count() or 1,
                         arch=platform.machine(), cpu_flags=_cpu_flags(), gpus=gpus,
                         gpu_offload=_llama_gpu_offload() if check_llama else None,
                         label=platform.node() or "this machine",
                         backends=llama_backends() if check_llama else (),
                         unified_memory=apple)


def _ram() -> tuple[int, int]:
    try:
        import psutil
        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except Exception:  # psutil missing or unsupported platform: fall back to the kernel's own numbers
        pass
    try:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, KeyError, ValueError, IndexError):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size, pages * size


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
    try:
        out = subprocess.run([exe, "--query-gpu=index,name,memory.total,memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            gpus.append(GPU(int(parts[0]), parts[1], int(float(parts[2])) * MiB,
                            int(float(parts[3])) * MiB if parts[3] not in ("", "[N/A]") else None))
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


# ---------------------------------------------------------------- CLI: clef-gguf pick

def add_arguments(parser) -> None:
    parser.add_argument("--family", default="clef-flash", help="model family (default: clef-flash)")
    parser.add_argument("--ctx", type=positive_int, default=DEFAULT_CONTEXT,
                        help=f"context tokens to budget KV for (default: {DEFAULT_CONTEXT})")
    parser.add_argument("--json", action="store_true", help="print the probe and recommendation as JSON")


def run(args) -> int:
    """``clef-gguf pick``: print this machine's profile and the recommended quant; 1 if nothing fits."""
    profile = probe()
    rec = recommend(profile, args.family, context_tokens=args.ctx)
    if args.json:
        print(json.dumps({"device": profile.to_dict(), "recommendation": rec.to_dict()}, indent=2))
        return 0 if rec.ok else 1
    feats = [n for n, on in (("AVX2", profile.avx2), ("AVX-512", profile.avx512), ("NEON", profile.neon)) if on]
    print(f"RAM:  {_gb(profile.total_ram)} total, {_gb(profile.available_ram)} available")
    print(f"CPU:  {profile.arch}, {profile.cpu_count} threads, features: {', '.join(feats) or 'none detected'}")
    if profile.gpus:
        for g in profile.gpus:
            free = f", {_gb(g.vram_free)} free" if g.vram_free is not None else ""
            print(f"GPU:  {g.index}: {g.name}, {_gb(g.vram_total)} VRAM{free}")
        offload = {True: "yes", False: "no (CPU-only build)", None: "unknown"}[profile.gpu_offload]
        print(f"      llama.cpp GPU offload: {offload}")
    else:
        print("GPU:  none")
    print(f"llama.cpp backends: {', '.join(('CPU',) + profile.backends)}"
          + ("" if profile.backends else " (a CPU-only build; see README for CUDA/Metal/Vulkan)"))
    print()
    if rec.ok:
        print(f"Recommended: {rec.name} (on {rec.placement.upper()})")
    else:
        print("Recommended: nothing fits")
    print(rec.reason)
    return 0 if rec.ok else 1
