"""The placement policy on synthetic machines: the quant that fits, where it runs, and the memory it may use."""

from __future__ import annotations

import json

import pytest

from clef_gguf.core.errors import NoQuantFits
from clef_gguf.models import Catalog, placement
from clef_gguf.core.limits import GiB, MiB
from clef_gguf.models.machine import GPU, DeviceProfile
from clef_gguf.models.placement import recommend


X86 = frozenset({"avx2", "fma", "sse4_2"})
PROFILES = {
    "8 GB laptop": DeviceProfile(8 * GiB, 6 * GiB, 8, "x86_64", X86),
    "16 GB laptop": DeviceProfile(16 * GiB, 11 * GiB, 8, "x86_64", X86),
    "32 GB desktop": DeviceProfile(32 * GiB, 26 * GiB, 16, "x86_64", X86 | {"avx512f"}),
    "8 GB ARM board": DeviceProfile(8 * GiB, int(7.2 * GiB), 4, "aarch64", frozenset({"asimd", "neon"})),
    "24 GB GPU box": DeviceProfile(64 * GiB, 50 * GiB, 16, "x86_64", X86,
                                   (GPU(0, "NVIDIA GeForce RTX 4090", 24 * GiB, int(23.5 * GiB)),), True),
    "4 GB board": DeviceProfile(4 * GiB, int(2.5 * GiB), 4, "aarch64", frozenset({"asimd"})),
}
# The policy table at the default 16,384-token context, with the packaged catalog. A decision of that many
# tokens takes 1.5 GiB of activations and 0.5 GiB of KV beyond a short one's: an 8 GB laptop has room
# for a 1-bit tower only (at --ctx 2048: Q3_K_S, test_a_short_context_fits_a_better_quant_on_a_laptop).
EXPECTED = {
    "8 GB laptop": ("clef-flash:Q1_0", "cpu"),
    "16 GB laptop": ("clef-flash:Q5_K_M", "cpu"),
    "32 GB desktop": ("clef-flash:Q8_0", "cpu"),
    "8 GB ARM board": ("clef-flash:Q2_K", "cpu"),
    "24 GB GPU box": ("clef-flash:Q8_0", "gpu"),  # BF16 fits but only from an unpinned source
    "4 GB board": (None, None),
}


@pytest.fixture(scope="module")
def cat():
    return Catalog.load()


@pytest.mark.parametrize("label", list(PROFILES))
def test_policy_table(cat, label):
    rec = recommend(PROFILES[label], "clef-flash", catalog=cat)
    assert (rec.name, rec.placement) == EXPECTED[label], rec.reason
    assert rec.context_tokens == 16384 and rec.reason


@pytest.mark.parametrize("label", list(PROFILES))
def test_choice_fits_and_nothing_better_does(cat, label):
    rec = recommend(PROFILES[label], "clef-flash", catalog=cat)
    names = [c.quant for c in rec.candidates]
    assert names == cat.family("clef-flash").quants()  # every quant was considered, best first
    if rec.ok:
        assert rec.need_bytes <= rec.budget_bytes
        chosen = names.index(rec.quant)
        family = cat.family("clef-flash")
        # Nothing better fits from a pinned source (unpinned ones are only a last resort).
        assert rec.candidates[chosen].fits
        assert not any(c.fits and family.source(c.source).pinned for c in rec.candidates[:chosen])
        assert rec.quant in rec.reason and "fits" in rec.reason
    else:
        assert not any(c.fits for c in rec.candidates)


def test_more_memory_never_gets_a_worse_quant(cat):
    rank = {q: i for i, q in enumerate(cat.family("clef-flash").quants())}
    last = len(rank)
    for gib in range(3, 40):
        rec = recommend(DeviceProfile(gib * GiB, gib * GiB), "clef-flash", catalog=cat)
        now = rank[rec.quant] if rec.ok else len(rank)
        assert now <= last, f"{gib} GiB got {rec.quant}"
        last = now


def test_too_little_memory_gives_a_clear_verdict(cat):
    rec = recommend(PROFILES["4 GB board"], "clef-flash", catalog=cat)
    assert not rec.ok and rec.quant is None and rec.placement is None
    assert rec.reason.startswith("No clef-flash quant fits this machine: the smallest, Q1_0")
    assert "usable" in rec.reason
    with pytest.raises(NoQuantFits) as err:
        rec.require()
    assert err.value.code == "no_quant_fits"
    # a smaller context is suggested when it would make the smallest quant fit
    squeezed = recommend(DeviceProfile(5 * GiB, 4 * GiB), "clef-flash", catalog=cat)
    assert not squeezed.ok and "--ctx 2048" in squeezed.reason
    assert recommend(DeviceProfile(5 * GiB, 4 * GiB), "clef-flash", catalog=cat, context_tokens=2048).ok


def test_context_and_kv_are_budgeted(cat):
    box = PROFILES["8 GB ARM board"]
    short, long = (recommend(box, "clef-flash", catalog=cat, context_tokens=n) for n in (4096, 65536))
    assert short.breakdown["kv_cache"] == 4096 * 32 * 1024
    assert long.breakdown["kv_cache"] == 2 * GiB
    assert short.breakdown["recurrent_state"] == 24 * (24_576 + 524_288) * 4
    rank = cat.family("clef-flash").quants().index
    assert long.quant is None or rank(short.quant) <= rank(long.quant)
    # the activations grow with the context too: a decision's hidden states and the head's, per token
    assert long.breakdown["activations"] == 16 * short.breakdown["activations"] > 0


def test_a_decision_is_budgeted_from_its_measured_parts(cat):
    """What a decision takes, part by part (benchmarks/memory.py at Clef-Flash's shape): the tower's file,
    the head as it runs (fp32), the runtime, and per token of context the KV cache and the activations."""
    laptop = PROFILES["8 GB laptop"]
    rec = recommend(laptop, "clef-flash", catalog=cat, context_tokens=2048)
    mem = cat.family("clef-flash").memory
    chosen = next(c for c in rec.candidates if c.quant == rec.quant)
    parts = (mem.head_bytes + mem.runtime_bytes + mem.compute_bytes + mem.recurrent_bytes_per_sequence
             + 2048 * (mem.kv_bytes_per_token + mem.activation_bytes_per_token))
    assert chosen.need_bytes == chosen.size_bytes + parts  # an exact (card) size: no margin
    for part in ("tower", "KV", "recurrent", "compute", "head", "runtime", "activations"):
        assert f"{part} " in rec.reason
    assert "vision tower" not in rec.reason
    # the Q4_K_M file this was measured on (5.25 GiB), at --ctx 2048: its measured peak was 6.29 GiB
    measured_peak, file = 6.29 * GiB, int(5.25 * GiB)
    assert 1.0 <= (file + parts) / measured_peak <= 1.10


def test_a_short_context_fits_a_better_quant_on_a_laptop(cat):
    laptop = PROFILES["8 GB laptop"]
    assert recommend(laptop, "clef-flash", catalog=cat, context_tokens=2048).quant == "Q3_K_S"
    q3_k_m = next(c for c in recommend(laptop, "clef-flash", catalog=cat, context_tokens=2048).candidates
                  if c.quant == "Q3_K_M")
    assert 5 * GiB < q3_k_m.need_bytes < 6 * GiB  # an 8 GB laptop with ~6.2 GiB free runs it


def test_pictures_add_the_vision_tower(cat):
    box = PROFILES["16 GB laptop"]
    text, pictures = (recommend(box, "clef-flash", catalog=cat, context_tokens=2048, pictures=p) for p in (False, True))
    vision = cat.family("clef-flash").memory.vision_bytes
    assert pictures.breakdown["vision_tower"] == vision > 2 * GiB and text.breakdown["vision_tower"] == 0
    quant = lambda rec: next(c for c in rec.candidates if c.quant == "Q4_K_M")  # noqa: E731
    assert quant(pictures).need_bytes - quant(text).need_bytes == vision
    assert "vision tower" in pictures.reason


def test_gpu_rules(cat):
    box = PROFILES["24 GB GPU box"]
    cpu_only_build = DeviceProfile(**{**box.__dict__, "gpu_offload": False})
    rec = recommend(cpu_only_build, "clef-flash", catalog=cat)
    assert rec.placement == "cpu" and rec.quant == "Q8_0" and "cannot offload" in rec.reason
    unknown = recommend(DeviceProfile(**{**box.__dict__, "gpu_offload": None}), "clef-flash", catalog=cat)
    assert unknown.placement == "gpu" and "CUDA" in unknown.reason
    small_gpu = DeviceProfile(16 * GiB, 12 * GiB, 8, "x86_64", X86, (GPU(0, "RTX 3060", 12 * GiB, 11 * GiB),), True)
    rec = recommend(small_gpu, "clef-flash", catalog=cat)
    assert rec.placement == "gpu" and rec.need_bytes <= rec.budget_bytes <= 11 * GiB
    assert recommend(box, "clef", catalog=cat).name == "clef:Q4_K_M"


def test_cpu_notes(cat):
    old = DeviceProfile(16 * GiB, 12 * GiB, 4, "x86_64", frozenset({"sse4_2"}))
    assert "no AVX2" in recommend(old, "clef-flash", catalog=cat).reason
    assert "NEON" in recommend(PROFILES["8 GB ARM board"], "clef-flash", catalog=cat).reason
    assert "BF16 is not picked for CPU" in recommend(PROFILES["32 GB desktop"], "clef-flash", catalog=cat).reason


def test_recommendation_serialises(cat):
    d = recommend(PROFILES["16 GB laptop"], "clef-flash", catalog=cat).to_dict()
    assert d["ok"] and d["name"] == "clef-flash:Q5_K_M" and json.dumps(d)
    assert all("fits" in c for c in d["candidates"])


MAC = DeviceProfile(16 * GiB, 12 * GiB, 10, "arm64", frozenset({"neon"}),
                    (GPU(0, "Apple silicon GPU (Metal, unified memory)", 16 * GiB, 12 * GiB),), True,
                    backends=("Metal",), unified_memory=True)


@pytest.mark.parametrize("name", [*PROFILES, "mac"])
def test_runtime_placement_agrees_with_pick(cat, name):
    """One policy: the runtime's default --gpu-layers for the recommended file is what pick says."""
    profile = MAC if name == "mac" else PROFILES[name]
    rec = recommend(profile, "clef-flash", catalog=cat)
    if not rec.ok:
        return
    family = cat.family("clef-flash")
    size, basis = family.tower_size(rec.quant)
    layers = placement.gpu_layers(profile, int(size * placement.SIZE_MARGIN[basis]), family)
    assert (layers == -1) == (rec.placement == "gpu"), (rec.placement, layers)
    if profile.gpu_offload is not True:
        assert layers == 0


def test_apple_silicon_uses_metal_in_unified_memory(cat):
    rec = recommend(MAC, "clef-flash", catalog=cat)
    assert rec.placement == "gpu"
    # unified memory: GPU placement still has to fit the one RAM budget, host side included
    assert rec.need_bytes + cat.family("clef-flash").memory.head_bytes <= placement.host_budget(MAC)
    too_big = placement.gpu_layers(MAC, 20 * GiB, "clef-flash", catalog=cat)
    assert too_big == 0


def test_a_tower_too_big_for_the_gpu_stays_on_the_cpu(cat):
    box = PROFILES["24 GB GPU box"]
    assert placement.gpu_layers(box, 5 * GiB, "clef-flash", catalog=cat) == -1
    assert placement.gpu_layers(box, 30 * GiB, "clef-flash", catalog=cat) == 0
    no_build = DeviceProfile(**{**box.__dict__, "gpu_offload": False})
    assert placement.gpu_layers(no_build, 5 * GiB, "clef-flash", catalog=cat) == 0


def test_free_bytes_is_the_roomiest_gpu_less_the_reserve_or_the_host_budget():
    full, unknown = GPU(0, "full", 24 * GiB, 0), GPU(1, "unreported", 8 * GiB, None)
    box = DeviceProfile(64 * GiB, 50 * GiB, 16, "x86_64", X86, (full, unknown), True)
    # 0 MiB free is a full GPU, not an unknown one; an unreported free figure counts the total
    assert placement.gpu_free(full) == 0
    assert placement.free_bytes(box, on_gpu=True) == 8 * GiB - placement.GPU_RESERVE
    assert placement.free_bytes(box, on_gpu=False) == placement.host_budget(box)
    tiny = DeviceProfile(**{**box.__dict__, "gpus": (GPU(0, "tiny", 256 * MiB, 256 * MiB),)})
    assert placement.free_bytes(tiny, on_gpu=True) == 0
    # no GPU, or unified memory: the host budget either way
    cpu = DeviceProfile(16 * GiB, 12 * GiB, 8, "x86_64", X86)
    assert placement.free_bytes(cpu, on_gpu=True) == placement.host_budget(cpu)
    assert placement.free_bytes(cpu, on_gpu=False) == placement.host_budget(cpu)
    assert placement.free_bytes(MAC, on_gpu=True) == placement.host_budget(MAC)
