"""Random towers written directly in their type (``convert.synthetic.tiled``): the quantizer's own
per-tensor mix, finite values of a sensible size, a file llama.cpp loads and the runtime decides with,
and the 9B-shape Q4_K_M tower in seconds (slow tier: 5.6 GB written, loaded and asked once)."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest

from clef_gguf.convert import quantize
from clef_gguf.convert.synthetic import big, tiled
from clef_gguf.core.errors import ConversionError
from clef_gguf.formats.gguf import open_gguf

REQUEST = {"state": "Invoice 7 is 40 days late.",
           "questions": {"late": {"type": "noul"},
                         "risk": {"type": "score", "criteria": ["low", "medium", "high"]}}}


def _types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in open_gguf(path).tensors}


@pytest.mark.parametrize("qtype", [*tiled.SCALE_FIELDS, gguf.GGMLQuantizationType.NVFP4,
                                   gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F16],
                         ids=lambda t: t.name)
def test_random_rows_are_finite_distinct_and_small(qtype):
    rows = tiled.random_rows(qtype, 4, 512, np.random.default_rng(0))
    values = tiled.values_of(qtype, rows) if qtype not in (gguf.GGMLQuantizationType.BF16,
                                                           gguf.GGMLQuantizationType.F16) else \
        gguf.quants.dequantize(rows, qtype)
    values = np.asarray(values, np.float32).reshape(4, 512)
    assert np.isfinite(values).all()
    assert 0 < np.abs(values).max() <= 0.1, np.abs(values).max()
    assert values.std() > 1e-3 and not np.array_equal(values[0], values[1])


def test_a_type_it_has_no_block_layout_for_is_refused_by_name():
    with pytest.raises(ConversionError, match="IQ2_XXS"):
        tiled.random_rows(gguf.GGMLQuantizationType.IQ2_XXS, 2, 256, np.random.default_rng(0))
    with pytest.raises(ConversionError, match="whole Q4_K blocks"):
        tiled.random_rows(gguf.GGMLQuantizationType.Q4_K, 2, 100, np.random.default_rng(0))


def test_the_mix_is_the_quantizers_tensor_for_tensor(tmp_path):
    """Q4_K_M written directly holds every tensor in the type llama.cpp's quantizer gives it."""
    bf16 = tmp_path / "bf16.gguf"
    big.write_random_tower(bf16, preset="tiny256", outtype="bf16")
    quantize.quantize_file(bf16, tmp_path / "q.gguf", "Q4_K_M", threads=1)
    direct = tmp_path / "direct.gguf"
    summary = tiled.write_tiled_tower(direct, preset="tiny256", outtype="Q4_K_M")
    assert _types(direct) == _types(tmp_path / "q.gguf")
    assert summary["tensor_types"]["Q6_K"] >= 1 and sorted(p.name for p in tmp_path.iterdir()) == [
        "bf16.gguf", "direct.gguf", "q.gguf"]  # no skeleton or partial file left behind


@pytest.mark.parametrize("outtype", ["Q4_K_M", "q8_0", "bf16", "f16", "nvfp4"])
def test_each_timing_type_loads_and_decides(tmp_path, outtype):
    from clef_gguf.runtime.model import Clef

    summary = big.build_random_model(tmp_path / "m", preset="tiny256", outtype=outtype)
    types = set(summary["tensor_types"])
    expected = {"Q4_K_M": {"Q4_K", "Q6_K"}, "q8_0": {"Q8_0"}, "bf16": {"BF16"}, "f16": {"F16"},
                "nvfp4": {"NVFP4", "BF16"}}[outtype]
    assert expected <= types, types
    if outtype == "nvfp4":  # each NVFP4 projection with its second scale, as the checkpoint's GGUF has it
        names = _types(summary["tower"])
        fp4 = [n for n, t in names.items() if t == "NVFP4"]
        assert fp4 and all(names[n.removesuffix(".weight") + ".scale"] == "F32" for n in fp4)
    with Clef.load(tmp_path / "m", threads=1, state_cache_mb=0) as clef:
        probs = np.concatenate(clef.probabilities(REQUEST))
    assert np.isfinite(probs).all() and ((probs > 0) & (probs < 1)).all()


def test_an_unknown_type_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ConversionError, match="Q9_Z"):
        big.build_random_model(tmp_path / "m", preset="tiny256", outtype="Q9_Z")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_9b_q4_k_m_tower_is_written_in_seconds_and_decides(tmp_path):
    """Clef-Flash's 9B shape in Q4_K_M (5.6 GB) written directly, loaded by llama.cpp, answering
    ordinary probabilities. The time is printed, not asserted (docs/gpu.md has the figures)."""
    from clef_gguf.runtime.model import Clef

    start = time.perf_counter()
    summary = big.build_random_model(tmp_path / "m", preset="flash9b", outtype="Q4_K_M")
    took = time.perf_counter() - start
    print(f"\n9B Q4_K_M model written in {took:.1f} s (tower {summary['write_s']} s, "
          f"{summary['tower_bytes'] / 1e9:.2f} GB)")
    try:
        assert summary["layers"] == 32 and 5.0e9 < summary["tower_bytes"] < 6.0e9
        assert summary["tensor_types"]["Q4_K"] > summary["tensor_types"]["Q6_K"] > 0
        with Clef.load(tmp_path / "m", state_cache_mb=0) as clef:
            enc = clef.prepare({"state": "Late.", "questions": {"late": {"type": "noul"}}}).encoded
            probs = clef.flat_probabilities(enc, clef.tower.hidden_states(enc.ids))
        assert probs.size and np.isfinite(probs).all() and ((probs > 0) & (probs < 1)).all()
    finally:
        for path in (tmp_path / "m").iterdir():
            path.unlink()  # 5.6 GB: not left for pytest's tmp_path retention
