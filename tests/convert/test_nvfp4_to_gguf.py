"""NVFP4 checkpoints re-encoded as llama.cpp NVFP4 GGUFs (``convert.nvfp4_to_gguf``): the bits moved, not
rounded (codes and block scales byte-equal after the re-layout, the second scale 1 / global scale, the
dequantized products equal), the file loaded by llama.cpp and answering close to the PyTorch backend,
the command line, and every refusal naming what is wrong with nothing half-written."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from clef_gguf import Clef
from clef_gguf.cli import main
from clef_gguf.convert import nvfp4_to_gguf as ng
from clef_gguf.convert import tensor_map as tm
from clef_gguf.core import errors
from clef_gguf.formats.files import from_directory, read_manifest
from clef_gguf.formats.safetensors import opened
from clef_gguf.tower.nvfp4 import format as fmt

REQUEST = {"state": "Invoice INV-7 for $1,250.00 is 40 days past due.",
           "questions": {"overdue": {"type": "noul"},
                         "action": {"type": "choice",
                                    "criteria": {"remind": "Send a reminder", "escalate": "Escalate"}},
                         "risk": {"type": "score", "criteria": ["low", "medium", "high"]}}}


@pytest.fixture(scope="module")
def converted(tiny_nvfp4_dir, tmp_path_factory):
    """scheme -> (checkpoint, NVFP4 GGUF model directory)."""
    made = {}

    def make(scheme):
        if scheme not in made:
            checkpoint = tiny_nvfp4_dir(scheme)
            made[scheme] = checkpoint, ng.convert_checkpoint(checkpoint, tmp_path_factory.mktemp(scheme) / "gguf")
        return made[scheme]
    return make


def _checkpoint_tensors(checkpoint):
    out = {}
    for shard in sorted(checkpoint.glob("model*.safetensors")):
        with opened(shard, field="src", kind="shard") as f:
            out |= {name: f.tensor(name) for name in f.names()}
    return out


@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
def test_codes_and_scales_are_the_checkpoints_bit_for_bit(converted, scheme):
    checkpoint, out = converted(scheme)
    reader = gguf.GGUFReader(from_directory(out).tower)
    gg = {t.name: t for t in reader.tensors}
    ck = _checkpoint_tensors(checkpoint)
    _, text, _ = ng.load_config(checkpoint)
    d = ng.text_dims(text, tied=False)
    modules = sorted(n[:-len(".weight_packed")] for n in ck if n.endswith(".weight_packed"))
    assert modules and sum(t.tensor_type == gguf.GGMLQuantizationType.NVFP4 for t in gg.values()) == len(modules)
    edited = set()
    for module in modules:
        name, edits = tm.gguf_name(module.removeprefix("model.language_model.") + ".weight")
        raw = np.asarray(gg[name].data)
        assert gg[name].tensor_type == gguf.GGMLQuantizationType.NVFP4
        codes, scales = ng.from_ggml_blocks(raw)
        want_codes = tm.apply_edits(fmt.unpack_fp4(ck[module + ".weight_packed"]), edits, d)
        scale_dims = ng._scale_dims(d, module) if "tile_v_cols" in edits else d
        want_scales = tm.apply_edits(ck[module + ".weight_scale"].view(torch.uint8), edits, scale_dims)
        assert torch.equal(codes, want_codes), module  # E2M1 codes: the same bytes after the re-layout
        assert torch.equal(scales, want_scales & 0x7F) and torch.equal(want_scales, want_scales & 0x7F), module
        g = ck[module + ".weight_global_scale"].float()
        second = np.asarray(gg[name.removesuffix(".weight") + ".scale"].data)
        assert second.dtype == np.float32 and second.tolist() == [np.float32(1.0) / np.float32(g.item())]
        # Dequantized: ggml's blocks (gguf-py's decoder, bit-equal to ggml's) times llama.cpp's second scale
        # against compressed-tensors' E2M1 x scale / global scale, edited the same way.
        ours = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.NVFP4).copy())
        packed, scale = ck[module + ".weight_packed"], ck[module + ".weight_scale"]
        ref = tm.apply_edits(fmt.dequantize_weight(packed, scale, g, torch.float32), edits, d)
        products = fmt.E2M1_VALUES[fmt.unpack_fp4(packed).long()] * scale.float().repeat_interleave(fmt.GROUP, -1)
        assert torch.equal(ours, tm.apply_edits(products, edits, d)), module  # E2M1 x block scale, exact in fp32
        assert torch.allclose(ours * float(second[0]), ref, rtol=2.5e-7, atol=0), module  # 1/g vs / g: an ulp
        edited |= set(edits)
    assert {"tile_v_rows_of_qkv", "tile_v_rows", "tile_v_cols"} <= edited  # the V-head reorders were exercised
    # W4A16 keeps Blackwell's activations at 8 bits; W4A4's static activation scales are dropped, and said so
    keys = reader.fields
    source = read_manifest(out)["source"]
    if scheme == "nvfp4a16":
        assert "general.tensor_extra.prec_a4" in keys and source["activation_scales"] is None
    else:
        assert "general.tensor_extra.prec_a4" not in keys
        assert "input_global_scale dropped" in source["activation_scales"]
    assert source["scheme"] == {"nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4"}[scheme]
    assert int(keys["general.file_type"].parts[-1][0]) == ng.FILE_TYPE


@pytest.mark.parametrize("scheme, bound", [("nvfp4a16", 0.03), ("nvfp4", 0.2)])
def test_the_gguf_answers_through_llama_cpp_near_the_pytorch_backend(converted, scheme, bound):
    """llama.cpp's CPU dot products quantize the activations to 8 bits; the PyTorch backend keeps them
    fp32 (A16) or rounds them to FP4 with the checkpoint's static scales (W4A4): close, not equal."""
    checkpoint, out = converted(scheme)
    with Clef.load(out) as clef:
        response = clef.decide(REQUEST)
        gguf_p = clef.probabilities(REQUEST)
        assert clef.info["backend"] == "llama-cpp-python" and response["audit"]["precision"] == "nvfp4"
    with Clef.load(checkpoint, backend="nvfp4") as clef:
        torch_p = clef.probabilities(REQUEST)
    assert max(float(np.abs(a - b).max()) for a, b in zip(gguf_p, torch_p)) < bound


def test_the_command_recognises_a_checkpoint_and_converts_a_release_in_one_step(tiny_nvfp4_dir, tiny_release,
                                                                                tmp_path, capsys):
    assert main(["convert", str(tiny_nvfp4_dir("nvfp4a16")), str(tmp_path / "a")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["outtype"] == "nvfp4-gguf" and summary["scheme"] == "NVFP4A16"
    assert main(["convert", str(tiny_release), str(tmp_path / "b"), "--outtype", "nvfp4-gguf"]) == 0
    assert json.loads(capsys.readouterr().out)["scheme"] == "NVFP4A16"
    assert not list(tmp_path.glob(".clef-gguf-nvfp4-*"))  # the intermediate checkpoint is gone
    with Clef.load(tmp_path / "b") as clef:
        assert clef.decide(REQUEST)["audit"]["precision"] == "nvfp4"
    # what a checkpoint cannot become, and flags that are the quantizer's
    assert main(["convert", str(tiny_nvfp4_dir("nvfp4a16")), str(tmp_path / "c"), "--outtype", "Q4_K_M"]) == 1
    assert "NVFP4 checkpoint" in json.loads(capsys.readouterr().out)["error"]["message"]
    assert main(["convert", str(tiny_release), str(tmp_path / "d"), "--outtype", "nvfp4-gguf",
                 "--imatrix", "uniform"]) == 1
    assert "--imatrix" in capsys.readouterr().out
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def _broken(checkpoint, tmp_path, edit):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    edit(bad)
    return bad


def _config_edit(change):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        change(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))
    return edit


def _group(q):
    return next(iter(q["config_groups"].values()))


@pytest.mark.parametrize("edit, words", [
    (_config_edit(lambda q: q.update(format="float-quantized")), "format is 'float-quantized'"),
    (_config_edit(lambda q: _group(q)["weights"].update(group_size=32)), "weights.group_size is 32"),
    (_config_edit(lambda q: _group(q)["weights"].update(num_bits=8)), "weights.num_bits is 8"),
])
def test_another_scheme_or_group_size_is_refused_naming_the_key(tiny_nvfp4_dir, tmp_path, edit, words):
    bad = _broken(tiny_nvfp4_dir("nvfp4a16"), tmp_path, edit)
    with pytest.raises(errors.ConversionError, match=words):
        ng.convert_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _rewrite_shard(path, change):
    from safetensors.torch import save_file

    shard = next(path.glob("model*.safetensors"))
    with opened(shard, field="src", kind="shard") as f:
        tensors = {name: f.tensor(name) for name in f.names()}
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def test_a_missing_scale_a_truncated_shard_and_a_short_row_name_the_tensor(tiny_nvfp4_dir, tmp_path):
    checkpoint = tiny_nvfp4_dir("nvfp4a16")
    module = "model.language_model.layers.0.mlp.up_proj"
    bad = _broken(checkpoint, tmp_path, lambda p: _rewrite_shard(p, lambda t: t.pop(f"{module}.weight_scale")))
    with pytest.raises(errors.ConversionError, match=rf"{module}.weight_scale is missing"):
        ng.convert_checkpoint(bad, tmp_path / "out")
    shutil.rmtree(bad)

    def truncate(path):
        shard = next(path.glob("model*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:-100])
    bad = _broken(checkpoint, tmp_path, truncate)
    with pytest.raises(errors.ClefError):
        ng.convert_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    # a row of 48 values is not whole ggml blocks of 64 (llama.cpp would refuse the file)
    found = {f"m.{ng.PACKED}": (None, [8, 24], "U8"), f"m.{ng.SCALE}": (None, [8, 3], "F8_E4M3"),
             f"m.{ng.GLOBAL}": (None, [1], "F32")}
    with pytest.raises(errors.ConversionError, match="m: rows of 48 values are not whole ggml NVFP4 blocks of 64"):
        ng._nvfp4_item("x.weight", "m", [8, 48], found, "blk.0.ffn_up.weight", ())


def test_a_lora_on_an_nvfp4_gguf_is_unsupported_naming_adapter(converted, tiny_fine_tunes, tmp_path, capsys):
    """llama.cpp aborts the process on a LoRA over a feed-forward weight with a second scale: refused first."""
    _, out = converted("nvfp4a16")
    with pytest.raises(errors.Unsupported, match="NVFP4 weights with a second scale") as caught:
        Clef.load(out, adapters=str(tiny_fine_tunes["a"]))
    assert caught.value.field == "adapter" and caught.value.code == "unsupported"
    (tmp_path / "r.json").write_text(json.dumps(REQUEST))
    assert main(["decide", "--model", str(out), "--adapter", str(tiny_fine_tunes["a"]),
                 "--request", str(tmp_path / "r.json")]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["field"] == "adapter"
