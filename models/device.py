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

NVFP4 checkpoints (the nvfp4 backend, PyTorch on CUDA) are listed beside the GGUF quants, never
chosen by ``auto``: on a GPU with FP4 tensor cores (Blackwell) a W4A4 checkpoint runs FP4 GEMMs;
elsewhere, and W4A16 everywhere, the backend dequantizes one layer at a time. Either way the packed
weights stay 4-bit in memory, which is what their need is budgeted for.
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
DEFAULT_CONTEXT = 16384  # the reference implementation's window (docs/design/clef-reference.md §11)
# A size that is only estimated gets a safety margin, so "fits" stays true when the real file arrives.
SIZE_MARGIN = {"exact": 1.0, "card": 1.0, "proxy": 1.03, "estimate": 1.10}
GPU_RESERVE = 512 * MiB  # CUDA context and allocator slack, which never show up as model memory
# Not picked for CPU placement: llama.cpp's CPU path streams every weight per token, so BF16 costs twice
# Q8_0's time for agreement Q8_0 already reaches (max |dp| 0.014 vs the bf16 reference, docs/design/landscape.md §6).
CPU_SKIP = frozenset({"BF16"})
# Compute capability majors with FP4 tensor cores (docs/design/nvfp4.md §3): sm_100/103 (B200, B300,
# GB200/GB300), sm_110 (Jetson Thor), sm_120/121 (RTX 50xx, RTX PRO Blackwell, DGX Spark). Hopper (9.0)
# and older have no FP4 MMA, so the nvfp4 backend dequantizes there (section 4).
NATIVE_FP4_MAJORS = frozenset({10, 11, 12})
# Schemes the nvfp4 backend runs on FP4 tensor cores there: an FP4 GEMM needs FP4 activations, so W4A16
# dequantizes layer by layer on every device (clef_gguf/nvfp4/kernels.py, kernel_name).
NATIVE_SCHEMES = frozenset({"W4A4"})


class NoQuantFits(ModelLoadError):
    """No quant of the family fits this machine's memory (the message says what would)."""

    code = "no_quant_fits"


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
class CheckpointCandidate:
    """An NVFP4 checkpoint on this machine: listed by ``pick``, pulled by name, never chosen by auto."""

    name: str  # clef-flash:NVFP4A16
    quant: str
    source: str
    repo: str
    size_bytes: int | None  # the download (the repository on disk); None: not published
    size_basis: str | None
    mode: str  # "native" (FP4 tensor cores) | "fallback" (dequantized to bf16 on the GPU) | "cpu"
    gpu: int | None
    need_bytes: int  # GPU memory in that mode (RAM for "cpu")
    budget_bytes: int
    fits: bool
    suitable: bool  # a CUDA GPU runs it and it fits: worth pulling by name
    reason: str


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
    nvfp4: tuple[CheckpointCandidate, ...] = ()  # by name only: not part of the choice above

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
    nvfp4 = checkpoint_candidates(profile, family, context_tokens=context_tokens, sequences=sequences)

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
                              breakdown, tuple(candidates), nvfp4)

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
                          reason, breakdown, tuple(candidates), nvfp4)


def native_fp4(gpu: GPU) -> bool | None:
    """True: the GPU has FP4 tensor cores (Blackwell); False: it has none; None: compute capability
    not reported (an old driver), so nobody can tell."""
    try:
        return int(str(gpu.compute_capability).split(".")[0]) in NATIVE_FP4_MAJORS
    except ValueError:
        return None


def fp4_note(gpu: GPU) -> str:
    """Whether ``gpu`` has native FP4, in words."""
    native, cc = native_fp4(gpu), gpu.compute_capability
    if native:
        return f"native FP4 (Blackwell, compute capability {cc})"
    if native is False:
        return f"dequantizing fallback (no FP4 tensor cores: {gpu.name}, cc {cc})"
    return f"dequantizing fallback assumed (compute capability not reported: {gpu.name})"


def _mode_note(gpu: GPU, scheme: str) -> tuple[bool, str]:
    """(runs on FP4 tensor cores, how the nvfp4 backend runs ``scheme`` on ``gpu``, in words)."""
    if native_fp4(gpu) and scheme not in NATIVE_SCHEMES:
        return False, (f"dequantizing fallback, layer by layer: {scheme} has no FP4 GEMM (its activations stay "
                       f"bf16) although this GPU has native FP4 (Blackwell, compute capability "
                       f"{gpu.compute_capability})")
    native = bool(native_fp4(gpu))
    return native, fp4_note(gpu) + ("" if native else ", layer by layer")


def checkpoint_candidates(profile: DeviceProfile, family: Family, *, context_tokens: int = DEFAULT_CONTEXT,
                          sequences: int = 1) -> tuple[CheckpointCandidate, ...]:
    """Each NVFP4 checkpoint of ``family`` on ``profile``: its mode, memory need, and whether it fits.

    Device memory: the packed FP4 layers and the bf16 embeddings as they are stored (the backend never
    makes a dense copy of the model), one dense layer at a time where it dequantizes, plus head, KV,
    recurrent state and compute; the host keeps the lexical rows and the Python runtime. Without a
    CUDA GPU none is suitable: the CPU fallback dequantizes every layer at every call, far slower
    than a GGUF quant of the same size."""
    mem = family.memory
    ctx = f"{context_tokens:,} tokens of context"
    state = mem.kv_bytes_per_token * context_tokens + mem.recurrent_bytes_per_sequence * sequences
    extras = mem.head_bytes + state + mem.compute_bytes
    host_side = mem.lexical_rows_bytes + mem.runtime_bytes
    host = host_budget(profile)
    # PyTorch uses the GPU whatever llama.cpp's build can do; Apple's unified-memory GPU is not CUDA.
    gpus = () if profile.unified_memory else profile.gpus
    out = []
    for src in family.checkpoint_sources:
        ck = src.checkpoint
        size, basis = ck.known_size() or (None, None)
        name = f"{family.name}:{ck.quant}"
        common = dict(name=name, quant=ck.quant, source=src.alias, repo=src.repo, size_bytes=size,
                      size_basis=basis)
        stored = ck.quantized_weights_bytes + ck.bf16_weights_bytes
        if not gpus:
            need = stored + ck.dequant_scratch_bytes + extras + host_side
            out.append(CheckpointCandidate(
                **common, mode="cpu", gpu=None, need_bytes=need, budget_bytes=host, fits=need <= host,
                suitable=False, reason=(f"{name} ({ck.scheme}) is not suitable here: no CUDA GPU, so the nvfp4 "
                                        "backend would run its dequantizing fallback on the CPU (slow; "
                                        f"{_gb(need)} of RAM at {ctx}); use a GGUF quant.")))
            continue
        options = []
        for gpu in gpus:
            native, how = _mode_note(gpu, ck.scheme)
            need = stored + (0 if native else ck.dequant_scratch_bytes) + extras
            budget = max(0, (gpu.vram_free if gpu.vram_free is not None else gpu.vram_total) - GPU_RESERVE)
            options.append((need <= budget and host_side <= host, native, budget, gpu, need, how))
        fits, native, budget, gpu, need, how = max(options, key=lambda o: o[:3])
        parts = (f"packed FP4 {_gb(ck.quantized_weights_bytes)} + bf16 embeddings {_gb(ck.bf16_weights_bytes)}"
                 + ("" if native else f" + one dequantized layer {_gb(ck.dequant_scratch_bytes)}")
                 + f" + head {_gb(mem.head_bytes)} + KV and recurrent state {_gb(state)}"
                 + f" + compute {_gb(mem.compute_bytes)}")
        reason = (f"{name} ({ck.scheme}, by name only) {'fits' if fits else 'does not fit'}: {how}; it needs "
                  f"{_gb(need)} of GPU memory at {ctx} ({parts}) of {_gb(budget)} usable on GPU {gpu.index} "
                  f"({gpu.name}).")
        if fits and not native:
            reason += (" Slower than FP4 tensor cores" + (", with W4A4's activations fake-quantized (same numbers)."
                                                          if ck.scheme in NATIVE_SCHEMES else "."))
        out.append(CheckpointCandidate(**common, mode="native" if native else "fallback", gpu=gpu.index,
                                       need_bytes=need, budget_bytes=budget, fits=fits, suitable=fits,
                                       reason=reason))
    return tuple(out)


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


GPU_QUERY = "index,name,memory.total,memory.free"


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


# ---------------------------------------------------------------- CLI: clef-gguf pick

def add_arguments(parser) -> None:
    parser.add_argument("--family", default="clef-flash", help="model family (default: clef-flash)")
    parser.add_argument("--ctx", type=positive_int, default=DEFAULT_CONTEXT,
                        help=f"context tokens to budget KV for (default: {DEFAULT_CONTEXT})")
    parser.add_argument("--json", action="store_true", help="print the probe and recommendation as JSON")
    parser.epilog = ("The recommendation is a GGUF quant. pick also lists the family's NVFP4 checkpoints "
                     "(clef-flash:nvfp4a16, clef-flash:nvfp4, clef:nvfp4; the nvfp4 backend, PyTorch on "
                     "CUDA) with their GPU memory need, and says whether this GPU runs FP4 natively "
                     "(Blackwell, compute capability 10.x/11.x/12.x: W4A4 on FP4 tensor cores) or through "
                     "the dequantizing fallback (other GPUs, and W4A16 everywhere). They are never chosen "
                     "automatically: pull one by name.")


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
            fp4 = "" if profile.unified_memory else f"; NVFP4: {fp4_note(g)}"
            print(f"GPU:  {g.index}: {g.name}, {_gb(g.vram_total)} VRAM{free}{fp4}")
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
    if rec.nvfp4:
        print()
        print("NVFP4 checkpoints (nvfp4 backend; pulled by name, never chosen automatically):")
        for c in rec.nvfp4:
            mark = "+" if c.suitable else "-"
            print(f"  {mark} {c.reason}")
    return 0 if rec.ok else 1
