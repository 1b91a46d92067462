"""The placement policy: the best quant that fits a machine, where it runs, and the memory it may use.

``recommend(profile, family)`` does no I/O: given the same ``DeviceProfile`` (``machine.probe``) and
catalog it always answers the same, which is what lets the tests pin the policy on synthetic machines
(8 GB laptop, Raspberry Pi, 24 GB GPU box, ...). ``gpu_layers`` applies the same rule to a loaded
tower, and ``free_bytes`` is the one answer to "how much memory may this model use".

Memory model for one decision context (all figures from the catalog's family entry, measured at the
family's shape by benchmarks/memory.py where the entry says so):
  tower file (llama.cpp reads all of it into memory at load; what stays is its repacked copies and the
  pages the CPU reads, less, but the load's peak holds the whole file)
  + head (as it runs, fp32) + runtime (Python, torch, both tokenizers, lexical rows)
  + KV cache (per token of context, allocated at load) + recurrent state (per sequence)
  + llama.cpp's compute buffers + activations (per token of context: hidden states, the head's)
  [+ the vision tower, for requests with pictures],
against min(available RAM - headroom, total RAM - a reserve for the OS). On a GPU with enough VRAM the tower,
KV, recurrent state and compute buffer go to VRAM instead and the host keeps the rest.

NVFP4 checkpoints (the nvfp4 backend, PyTorch on CUDA) are listed beside the GGUF quants, never
chosen by ``auto``: on a GPU with FP4 tensor cores (Blackwell) a W4A4 checkpoint runs FP4 GEMMs;
elsewhere, and W4A16 everywhere, the backend dequantizes one layer at a time. Either way the packed
weights stay 4-bit in memory, which is what their need is budgeted for.
Past 400 lines because the policy's steps (need, candidates, choice, reasons) read in one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from clef_gguf.core.errors import NoQuantFits
from clef_gguf.core.limits import CONTEXT_WINDOW, GB, GiB, MiB
from clef_gguf.models.catalog import GGUF_SUFFIX, Catalog, Family, load_catalog
from clef_gguf.models.machine import GPU, DeviceProfile, native_fp4

DEFAULT_CONTEXT = CONTEXT_WINDOW
# A size that is only estimated gets a safety margin, so "fits" stays true when the real file arrives.
SIZE_MARGIN = {"exact": 1.0, "card": 1.0, "proxy": 1.03, "estimate": 1.10}
GPU_RESERVE = 512 * MiB  # CUDA context and allocator slack, which never show up as model memory
# Not picked for CPU placement: llama.cpp's CPU path streams every weight per token, so BF16 costs twice
# Q8_0's time for agreement Q8_0 already reaches (max |dp| 0.014 vs the bf16 reference, docs/design/landscape.md §6).
CPU_SKIP = frozenset({"BF16"})
# Schemes the nvfp4 backend runs on FP4 tensor cores (on a GPU ``machine.native_fp4`` accepts): an FP4
# GEMM needs FP4 activations, so W4A16 dequantizes layer by layer on every device
# (clef_gguf/tower/nvfp4/kernels.py, kernel_name).
NATIVE_SCHEMES = frozenset({"W4A4"})


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
    # The same checkpoint re-encoded as an NVFP4 GGUF (``FAMILY:QUANT-GGUF``): llama.cpp on any device,
    # budgeted as a GGUF quant of its size; by name only too
    gguf: Candidate | None = None


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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"], d["name"] = self.ok, self.name
        for c in [*d["candidates"], *(n["gguf"] for n in d["nvfp4"] if n["gguf"])]:
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


def gpu_free(gpu: GPU) -> int:
    """Bytes the policy may use on ``gpu``: its free VRAM (its total when the driver does not say),
    less ``GPU_RESERVE``. 0 MiB free is a full GPU, not an unknown one."""
    return max(0, (gpu.vram_free if gpu.vram_free is not None else gpu.vram_total) - GPU_RESERVE)


def free_bytes(profile: DeviceProfile, on_gpu: bool) -> int:
    """Bytes a model placed on the GPU (``on_gpu``) or on the host may use: on a discrete GPU the
    roomiest GPU's ``gpu_free``; otherwise (no GPU, unified memory, or host placement) the host
    budget."""
    if on_gpu and profile.gpus and not profile.unified_memory:
        return max(gpu_free(g) for g in profile.gpus)
    return host_budget(profile)


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class _Need:
    """What a family's model needs besides its tower, part by part and by where it lives."""

    kv: int
    recurrent: int
    activations: int
    vision: int
    device_side: int  # moves to VRAM with the tower: KV cache, recurrent state, compute
    host_side: int  # stays on the host: head, runtime, activations, the vision tower


def _need(family: Family, context_tokens: int, sequences: int, pictures: bool = False) -> _Need:
    mem = family.memory
    kv = mem.kv_bytes_per_token * context_tokens
    rec = mem.recurrent_bytes_per_sequence * sequences
    act = mem.activation_bytes_per_token * context_tokens
    vision = mem.vision_bytes if pictures else 0
    return _Need(kv, rec, act, vision, kv + rec + mem.compute_bytes,
                 mem.head_bytes + mem.runtime_bytes + act + vision)


def parts(family: Family, need: _Need, tower: int, placement: str = "cpu") -> str:
    """What a need is made of, in words (``pick``'s reason): each part and its size."""
    mem = family.memory
    out = (f"tower {gib(tower)} + KV {gib(need.kv)} + recurrent {gib(need.recurrent)} + compute "
           f"{gib(mem.compute_bytes)}")
    if placement != "gpu":
        out += (f" + head {gib(mem.head_bytes)} + runtime {gib(mem.runtime_bytes)} + activations "
                f"{gib(need.activations)}" + (f" + vision tower {gib(need.vision)}" if need.vision else ""))
    return out


def recommend(profile: DeviceProfile, family: Family | str = "clef-flash", *,
              context_tokens: int = DEFAULT_CONTEXT, sequences: int = 1, pictures: bool = False,
              catalog: Catalog | None = None) -> Recommendation:
    """The highest-quality quant of ``family`` that fits ``profile``, with the reason and the candidates.
    ``pictures``: decisions carry pictures (the vision tower is loaded with the first).

    Pure: reads nothing but its arguments (and the packaged catalog when ``family`` is a name).
    """
    if isinstance(family, str):
        family = (catalog or load_catalog()).family(family)
    if context_tokens < 1 or sequences < 1:
        raise ValueError("context_tokens and sequences must be positive")
    mem, need = family.memory, _need(family, context_tokens, sequences, pictures)
    breakdown = {"kv_cache": need.kv, "recurrent_state": need.recurrent, "head": mem.head_bytes,
                 "compute": mem.compute_bytes, "runtime": mem.runtime_bytes, "activations": need.activations,
                 "vision_tower": need.vision, "os_reserve": os_reserve(profile.total_ram),
                 "free_headroom": free_headroom(profile.total_ram)}
    host = host_budget(profile)
    gpu, gpu_budget = _gpu_budget(profile)
    nvfp4 = checkpoint_candidates(profile, family, context_tokens=context_tokens, sequences=sequences)
    candidates = _candidates(profile, family, need, gpu_budget)
    chosen = _choose(family, candidates)
    if chosen is None:
        reason = _nothing_fits(profile, family, candidates, need, context_tokens, gpu_budget)
        return Recommendation(family.name, None, None, None, context_tokens, host, None, reason,
                              breakdown, tuple(candidates), nvfp4)
    placement = "gpu" if chosen.fits_gpu else "cpu"
    budget = gpu_budget if placement == "gpu" else host
    needed = chosen.need_bytes - (need.host_side if placement == "gpu" else 0)
    reason = (_fit_reason(profile, family, chosen, need, placement, gpu, budget, needed, context_tokens)
              + _notes(profile, family, candidates, chosen, placement, gpu, gpu_budget))
    return Recommendation(family.name, chosen.quant, chosen.source, placement, context_tokens, budget, needed,
                          reason, breakdown, tuple(candidates), nvfp4)


def _candidates(profile: DeviceProfile, family: Family, need: _Need, gpu_budget: int) -> list[Candidate]:
    """Every quant of ``family`` in catalog (quality) order, each with its need and where it fits."""
    out = []
    for quant in family.quants():
        size, basis = family.tower_size(quant)
        tower = int(size * SIZE_MARGIN[basis])
        fits_cpu, fits_gpu = _fits(profile, tower, need.device_side, need.host_side, gpu_budget)
        out.append(Candidate(quant, family.tower_source(quant).alias, size, basis,
                             tower + need.device_side + need.host_side, fits_cpu and quant not in CPU_SKIP, fits_gpu))
    return out


def _choose(family: Family, candidates: list[Candidate]) -> Candidate | None:
    """The best that fits: from a pinned source first (a recommendation should be reproducible),
    from an unpinned one only if nothing else fits."""
    pinned = [c for c in candidates if family.source(c.source).pinned]
    return next((c for c in pinned if c.fits), None) or next((c for c in candidates if c.fits), None)


def _kept_free(profile: DeviceProfile) -> str:
    return (f"{gib(profile.available_ram)} available; {gib(free_headroom(profile.total_ram))} of it and "
            f"{gib(os_reserve(profile.total_ram))} of the total kept free")


def _nothing_fits(profile: DeviceProfile, family: Family, candidates: list[Candidate], need: _Need,
                  context_tokens: int, gpu_budget: int) -> str:
    """Why no quant fits, the smallest's need, and whether a smaller context would do."""
    host = host_budget(profile)
    smallest = min(candidates, key=lambda c: c.need_bytes)
    small_ctx = 2048
    small = _need(family, small_ctx, 1, pictures=need.vision > 0)
    at_small = smallest.need_bytes - need.device_side - need.host_side + small.device_side + small.host_side
    hint = (f" With --ctx {small_ctx} it would need {gib(at_small)}."
            if context_tokens > small_ctx and at_small <= host else "")
    return (f"No {family.name} quant fits this machine: the smallest, {smallest.quant} "
            f"({smallest.size_bytes / GB:.2f} GB, {smallest.size_basis} size), needs "
            f"{gib(smallest.need_bytes)} at {context_tokens:,} tokens of context but only {gib(host)} of RAM "
            f"is usable ({_kept_free(profile)})"
            + (f" and {gib(gpu_budget)} of VRAM" if gpu_budget else "") + f".{hint}"
            " Free memory, use a smaller context, or a machine with more memory.")


def _fit_reason(profile: DeviceProfile, family: Family, chosen: Candidate, need: _Need, placement: str,
                gpu: GPU | None, budget: int, needed: int, context_tokens: int) -> str:
    """What ``chosen`` needs, part by part, of the memory where it is placed."""
    tower = chosen.need_bytes - need.device_side - need.host_side
    made_of = parts(family, need, tower, placement)
    if placement == "gpu" and gpu is not None:  # a GPU placement has a GPU: gpu_budget > 0
        where = f"{gib(budget)} of VRAM usable on GPU {gpu.index} ({gpu.name})"
    else:
        where = f"{gib(budget)} of RAM usable ({_kept_free(profile)})"
    return (f"{chosen.quant} from {chosen.source} ({chosen.size_bytes / GB:.2f} GB, {chosen.size_basis} size)"
            f" is the best quant that fits: it needs {gib(needed)} at {context_tokens:,} tokens of context "
            f"({made_of}) of {where}.")


def _notes(profile: DeviceProfile, family: Family, candidates: list[Candidate], chosen: Candidate,
           placement: str, gpu: GPU | None, gpu_budget: int) -> str:
    """What else the user should know: the next better quant, what was passed over and why, the build."""
    reason = ""
    better = [c for c in candidates[:candidates.index(chosen)] if c.quant not in CPU_SKIP or gpu_budget]
    if better:
        reason += f" The next better, {better[-1].quant}, needs {gib(better[-1].need_bytes)}."
    if placement == "cpu" and candidates[0].quant in CPU_SKIP and candidates[0].need_bytes <= host_budget(profile):
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
    return reason + _cpu_note(profile, placement)


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

    Device memory: the packed FP4 layers and the bf16 embeddings as they are stored, one dense layer at
    a time where it dequantizes (the small-memory mode: the budget assumes no dense copy of the model),
    plus head, KV, recurrent state and compute; the host keeps the runtime and the activations.
    Without a CUDA GPU none is suitable: the PyTorch fallback on the CPU is far slower than a GGUF quant
    of the same size. Each also has its NVFP4 GGUF (``gguf``): the same codes and scales through
    llama.cpp, budgeted as a GGUF quant of its file (packed layers, bf16 embeddings and output matrix)."""
    mem = family.memory
    ctx = f"{context_tokens:,} tokens of context"
    state = mem.kv_bytes_per_token * context_tokens + mem.recurrent_bytes_per_sequence * sequences
    activations = mem.activation_bytes_per_token * context_tokens
    extras = mem.head_bytes + state + mem.compute_bytes
    host_side = mem.runtime_bytes + activations
    host = host_budget(profile)
    # PyTorch uses the GPU whatever llama.cpp's build can do; Apple's unified-memory GPU is not CUDA.
    gpus = () if profile.unified_memory else profile.gpus
    _, gpu_budget = _gpu_budget(profile)
    out = []
    for src, ck in family.checkpoints:
        size, basis = ck.known_size() or (None, None)
        name = f"{family.name}:{ck.quant}"
        stored = ck.quantized_weights_bytes + ck.bf16_weights_bytes
        # The NVFP4 GGUF holds the packed layers and, in bf16, the embeddings and the output matrix (the
        # lexical rows' source, same shape): as any tower file, all of it budgeted resident.
        file_bytes = ck.quantized_weights_bytes + 2 * ck.bf16_weights_bytes
        tower = int(file_bytes * SIZE_MARGIN["estimate"])
        device_side = state + mem.compute_bytes
        host_gguf = mem.head_bytes + mem.runtime_bytes + activations
        fits_cpu, fits_gpu = _fits(profile, tower, device_side, host_gguf, gpu_budget)
        common: dict[str, Any] = dict(
            name=name, quant=ck.quant, source=src.alias, repo=src.repo, size_bytes=size, size_basis=basis,
            gguf=Candidate(ck.quant + GGUF_SUFFIX, src.alias, file_bytes, "estimate",
                           tower + device_side + host_gguf, fits_cpu, fits_gpu))
        if not gpus:
            need = stored + ck.dequant_scratch_bytes + extras + host_side
            out.append(CheckpointCandidate(
                **common, mode="cpu", gpu=None, need_bytes=need, budget_bytes=host, fits=need <= host,
                suitable=False, reason=(f"{name} ({ck.scheme}) is not suitable here: no CUDA GPU, so the nvfp4 "
                                        "backend would run its dequantizing fallback on the CPU (slow; "
                                        f"{gib(need)} of RAM at {ctx}); use a GGUF K-quant, the fast CPU path "
                                        f"({family.name}:{(ck.quant + GGUF_SUFFIX).lower()} runs this checkpoint "
                                        "through llama.cpp, slower still on a CPU).")))
            continue
        options = []
        for gpu in gpus:
            native, how = _mode_note(gpu, ck.scheme)
            need = stored + (0 if native else ck.dequant_scratch_bytes) + extras
            budget = gpu_free(gpu)
            options.append((need <= budget and host_side <= host, native, budget, gpu, need, how))
        fits, native, budget, gpu, need, how = max(options, key=lambda o: o[:3])
        parts = (f"packed FP4 {gib(ck.quantized_weights_bytes)} + bf16 embeddings {gib(ck.bf16_weights_bytes)}"
                 + ("" if native else f" + one dequantized layer {gib(ck.dequant_scratch_bytes)}")
                 + f" + head {gib(mem.head_bytes)} + KV and recurrent state {gib(state)}"
                 + f" + compute {gib(mem.compute_bytes)}")
        reason = (f"{name} ({ck.scheme}, by name only) {'fits' if fits else 'does not fit'}: {how}; it needs "
                  f"{gib(need)} of GPU memory at {ctx} ({parts}) of {gib(budget)} usable on GPU {gpu.index} "
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
    gpu = max(profile.gpus, key=gpu_free, default=None)
    if gpu is None or profile.gpu_offload is False:
        return gpu, 0
    # Unified memory: the GPU's memory is the RAM the host budget already counts (free_bytes says so).
    return gpu, free_bytes(profile, on_gpu=True)


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
    need = _need(family, context_tokens, sequences=1)
    _, budget = _gpu_budget(profile)
    return -1 if _fits(profile, tower_bytes, need.device_side, need.host_side, budget)[1] else 0


def _cpu_note(profile: DeviceProfile, placement: str) -> str:
    if placement != "cpu":
        return ""
    machine = profile.arch.lower()
    if machine in ("x86_64", "amd64", "i686") and profile.cpu_flags and not profile.avx2:
        return " This CPU has no AVX2: llama.cpp's quantized kernels will be slow."
    if machine in ("aarch64", "arm64") and profile.neon:
        return " ARM with NEON: Q4_0 gets llama.cpp's repacked ARM kernels and may run faster."
    return ""
