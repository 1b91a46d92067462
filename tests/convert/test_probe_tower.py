"""The speed probe's tower: the types llama.cpp's dry run plans on the skeleton are the real file's, tensor
for tensor; the retyped tensors hold whole blocks of those types; the probe file loads in llama.cpp at the
family's full shapes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from clef_gguf.convert import probe_tower, quantize
from clef_gguf.convert.synthetic.big import write_random_tower
from clef_gguf.tower.llama_tower import Tower

PRESET = "small"  # 12 layers 3:1, every row a multiple of 256: each layer-dependent rule applies


@pytest.fixture(scope="module")
def small_bf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe-real") / "small-bf16.gguf"
    write_random_tower(path, preset=PRESET, outtype="bf16")
    return path


@pytest.fixture(scope="module")
def skeleton(tmp_path_factory):
    work = tmp_path_factory.mktemp("probe-skeleton")
    path = work / "skeleton-bf16.gguf"
    summary = probe_tower.write_skeleton(path, PRESET, work)
    assert summary["layers"] == 12
    return path


def _block_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if t.name.startswith("blk.")}


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q3_K_M", "IQ2_M"])
def test_the_dry_run_on_the_skeleton_plans_the_real_files_type_for_every_block_tensor(small_bf16, skeleton,
                                                                                       tmp_path, quant):
    real = quantize.quantize_file(small_bf16, tmp_path / "real.gguf", quant,
                                  imatrix="uniform" if quant in quantize.NEEDS_IMATRIX else None)
    assert real["tensor_types"]  # the mixes put some layers in wider types: the comparison means something
    planned = probe_tower.planned_types(skeleton, quant)
    want = _block_types(tmp_path / "real.gguf")
    assert want == {name: kind for name, kind in planned.items() if name.startswith("blk.")}
    assert len(set(want.values()) - {"F32"}) >= 2  # Q4_K and Q6_K (or Q3_K, Q4_K, Q5_K): a real mix
    assert not skeleton.with_suffix(".dry").exists()  # a dry run writes nothing


def test_retyped_tensors_hold_whole_blocks_of_the_planned_type(skeleton):
    stored = probe_tower.read_tensors(skeleton)
    retyped = probe_tower.retyped(stored, probe_tower.planned_types(skeleton, "IQ4_XS"))
    down = retyped["blk.11.ffn_down.weight"]  # 1,536 wide: six IQ4_XS blocks of 136 bytes per row
    assert down.qtype.name == "IQ4_XS" and down.rows.shape == (2, 6 * 136) and not down.rows.any()
    assert retyped["blk.0.attn_norm.weight"] is stored["blk.0.attn_norm.weight"]  # F32 stays as it was
    with pytest.raises(Exception, match="blk.0.ffn_down.weight.*whole IQ4_XS blocks"):
        probe_tower.retyped({"blk.0.ffn_down.weight": probe_tower.StoredTensor(
            stored["blk.0.ffn_down.weight"].qtype, np.zeros((2, 200), np.uint8), (2, 100))},
            {"blk.0.ffn_down.weight": "IQ4_XS"})
    with pytest.raises(ValueError, match="Q7_X is not a type"):
        probe_tower.planned_types(skeleton, "Q7_X")


def test_a_quantized_skeleton_has_the_planned_types_and_real_rows(skeleton, tmp_path):
    """The small tower probed whole gets llama.cpp's quantized rows (an IQ type's lookups cost by value)."""
    stored = probe_tower.quantized(skeleton, "IQ2_XXS", tmp_path)
    planned = probe_tower.planned_types(skeleton, "IQ2_XXS")
    assert {n: t.qtype.name for n, t in stored.items() if n.startswith("blk.")} == \
        {n: k for n, k in planned.items() if n.startswith("blk.")}
    assert stored["blk.11.ffn_up.weight"].rows.any()  # quantized values, not zeros
    assert not list(tmp_path.glob("skeleton-*.gguf"))  # the quantized file is not kept


def test_the_probe_copies_layers_close_to_the_average_and_loads_at_full_shape(skeleton, tmp_path):
    stored = probe_tower.retyped(probe_tower.read_tensors(skeleton), probe_tower.planned_types(skeleton, "Q4_K_M"))
    sources = probe_tower.choose_layers(stored, PRESET, 4)
    assert len(sources) == 4 and sources[3] % 4 == 3 and all(s % 4 != 3 for s in sources[:3])
    # The chosen linear layers' ffn_down bytes are the closest any three give to 3x the average.
    down = {i: stored[f"blk.{i}.ffn_down.weight"].row_bytes for i in range(12) if i % 4 != 3}
    mean = sum(down.values()) / len(down)
    assert abs(sum(down[s] for s in sources[:3]) - 3 * mean) <= max(down.values()) - min(down.values())
    written = probe_tower.write_probe(tmp_path / "probe.gguf", stored, PRESET, sources, tmp_path)
    assert written["layers"] == 4
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "probe.gguf")).tensors}
    up = tensors["blk.0.ffn_up.weight"]
    assert [int(n) for n in up.shape] == [512, 1536]  # ne: 512 wide, the full 1,536 rows
    assert up.tensor_type.name == stored[f"blk.{sources[0]}.ffn_up.weight"].qtype.name
    with Tower.load(tmp_path / "probe.gguf", threads=1) as tower:
        assert tower.n_layer == 4 and tower.n_embd == 512
        hidden = tower.hidden_states(np.arange(300, 364, dtype=np.int32))
    assert hidden.shape == (64, 512) and np.isfinite(hidden).all()


def test_a_probe_of_every_layer_copies_each_as_it_is(skeleton):
    stored = probe_tower.retyped(probe_tower.read_tensors(skeleton), probe_tower.planned_types(skeleton, "Q4_K_M"))
    assert probe_tower.choose_layers(stored, PRESET, 12) == list(range(12))


def test_a_probe_needs_the_skeletons_tensors(skeleton, tmp_path):
    stored = probe_tower.read_tensors(skeleton)
    del stored["blk.0.ffn_up.weight"]
    with pytest.raises(Exception, match="blk.0.ffn_up.weight"):
        probe_tower.write_probe(tmp_path / "probe.gguf", stored, PRESET, [0, 1, 2, 3], tmp_path)


def test_zero_tensors_are_holes_in_the_probe_and_every_tensor_reads_back(skeleton, tmp_path):
    """The bf16 probe at a big shape: its matrices zeros (``retyped`` with nothing planned), written as
    holes, read back as zeros; a tensor with values among them (a whole-tower probe's rows) is tiled."""
    real = probe_tower.read_tensors(skeleton)
    stored = probe_tower.retyped(real, {})
    up = stored["blk.0.ffn_up.weight"]
    assert up.qtype.name == "BF16" and not up.rows.any()
    assert stored["blk.0.attn_norm.weight"] is real["blk.0.attn_norm.weight"]  # F32: its values
    stored["blk.0.ffn_up.weight"] = real["blk.0.ffn_up.weight"]
    path = tmp_path / "probe.gguf"
    probe_tower.write_probe(path, stored, PRESET, [0, 1, 2, 3], tmp_path)
    tensors = {t.name: np.asarray(t.data).view(np.uint8) for t in gguf.GGUFReader(str(path)).tensors}
    assert np.array_equal(tensors["blk.0.ffn_up.weight"].reshape(1536, -1),
                          np.tile(real["blk.0.ffn_up.weight"].rows, (768, 1)))  # 2 rows to 1,536
    assert not tensors["blk.1.ffn_up.weight"].any() and tensors["blk.1.ffn_up.weight"].size == 1536 * 1024
    assert np.array_equal(tensors["blk.0.attn_norm.weight"], real["blk.0.attn_norm.weight"].rows.ravel())
    size = path.stat().st_size
    assert path.stat().st_blocks * 512 < size / 2  # the zeros take no space
    assert not list(tmp_path.glob("*.partial"))
    with Tower.load(path, threads=1) as tower:
        hidden = tower.hidden_states(np.arange(300, 332, dtype=np.int32))
    assert hidden.shape == (32, 512) and np.isfinite(hidden).all()


def test_the_nvfp4_probe_plans_what_a_converted_checkpoint_holds(tiny_release, tmp_path):
    """The probe's NVFP4 GGUF has NVFP4 (with a second scale) exactly where ``convert.nvfp4_to_gguf`` puts it
    for a checkpoint of the same shapes, and the bf16 skeleton's types elsewhere."""
    from clef_gguf.convert.nvfp4 import quantize_release
    from clef_gguf.convert.nvfp4_to_gguf import convert_checkpoint
    from clef_gguf.formats.files import from_directory

    out = convert_checkpoint(quantize_release(tiny_release, tmp_path / "ck", scheme="nvfp4a16"), tmp_path / "gguf")
    real = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(from_directory(out).tower)).tensors}
    skeleton = tmp_path / "skeleton.gguf"
    probe_tower.write_skeleton(skeleton, "tiny", tmp_path)
    planned = probe_tower.nvfp4_retyped(probe_tower.read_tensors(skeleton), "tiny")
    fp4 = {n for n, t in planned.items() if t.qtype.name == "NVFP4"}
    assert fp4 == {n for n, k in real.items() if k == "NVFP4"} and len(fp4) > 10
    scales = {n for n in planned if n.endswith(probe_tower.SECOND_SCALE)}
    assert scales == {n for n in real if n.endswith(probe_tower.SECOND_SCALE)}
    assert scales == {n.removesuffix(".weight") + ".scale" for n in fp4}
    assert planned["blk.0.ssm_alpha.weight"].qtype.name == "BF16"  # the GDN gates' small projections: kept


def test_an_nvfp4_probe_loads_at_full_shape_with_its_scales_and_tags(skeleton, tmp_path):
    stored = probe_tower.nvfp4_retyped(probe_tower.read_tensors(skeleton), PRESET)
    sources = probe_tower.choose_layers(stored, PRESET, 4)
    path = tmp_path / "probe.gguf"
    probe_tower.write_probe(path, stored, PRESET, sources, tmp_path, nvfp4_a16=True)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.attn_qkv.weight"].tensor_type.name == "NVFP4"
    assert [int(n) for n in tensors["blk.0.ffn_up.weight"].shape] == [512, 1536]
    assert float(np.asarray(tensors["blk.3.attn_q.scale"].data).view(np.float32)[0]) == 1.0
    tagged = reader.fields["general.tensor_extra.name"]
    names = {bytes(tagged.parts[i]).decode() for i in tagged.data}
    assert names == {n for n, t in tensors.items() if t.tensor_type.name == "NVFP4"}
    with Tower.load(path, threads=1) as tower:
        hidden = tower.hidden_states(np.arange(300, 332, dtype=np.int32))
    assert hidden.shape == (32, 512) and np.isfinite(hidden).all()
    untagged = tmp_path / "w4a4.gguf"
    probe_tower.write_probe(untagged, stored, PRESET, sources, tmp_path)
    assert "general.tensor_extra.name" not in gguf.GGUFReader(str(untagged)).fields
