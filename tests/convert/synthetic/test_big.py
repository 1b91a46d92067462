"""The streaming writer of random full-size models (``convert.synthetic.big``), checked at toy sizes: its
tensors are the converter's, drawn in row blocks or not, and the 9B plan has the 9B shape."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clef_gguf.convert.synthetic import big
from clef_gguf.core.errors import ConversionError
from clef_gguf.formats.gguf import field_value, open_gguf

TINY_SEED = 0  # the seed of conftest's tiny_release


def _tensors(path) -> dict:
    return {t.name: (t.tensor_type, np.asarray(t.data)) for t in open_gguf(path).tensors}


def _same_tower(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for name, (kind, data) in ta.items():
        assert tb[name][0] == kind, name
        assert np.array_equal(tb[name][1], data), name
    ra, rb = open_gguf(a), open_gguf(b)
    keys = {k for k in ra.fields if not k.startswith("GGUF.")} | {k for k in rb.fields if not k.startswith("GGUF.")}
    differ = [k for k in keys if k not in ra.fields or k not in rb.fields
              or ra.fields[k].contents() != rb.fields[k].contents()]
    assert differ == ["general.name"]


@pytest.mark.parametrize("chunk", [None, 8192], ids=["whole", "row-blocks"])
def test_stream_equals_release_then_convert(tiny_release, tiny_model_dir_factory, tmp_path, monkeypatch, chunk):
    """Same generator, same draw order, same edits: the streamed tower is byte for byte the one
    build_release + convert_release give, also when the large tensors are drawn in row blocks."""
    if chunk is not None:
        monkeypatch.setattr(big, "CHUNK_ELEMENTS", chunk)
        assert 640 * 64 > chunk  # the tiny embedding and lm_head take the row-block path
    out = tmp_path / "stream.gguf"
    summary = big.write_random_tower(out, preset="tiny", outtype="bf16", seed=TINY_SEED,
                                     tokenizer_json=tiny_release / "tokenizer.json")
    assert summary["tensors"] == len(open_gguf(out).tensors)
    _same_tower(tiny_model_dir_factory("bf16") / "tower-bf16.gguf", out)


def test_refuses_without_the_disk_space(tmp_path, monkeypatch):
    monkeypatch.setattr(big, "_free_bytes", lambda out: 2 << 30)
    with pytest.raises(ConversionError, match="GB free"):
        big.build_random_model(tmp_path / "m", preset="flash9b")
    assert not (tmp_path / "m").exists()


def test_quantized_model_decides_and_leaves_no_intermediate(tmp_path, capsys):
    from clef_gguf.runtime.model import Clef

    assert big.main([str(tmp_path / "m"), "--preset", "tiny256", "--outtype", "q4_k_m"]) == 0
    summary = json.loads(capsys.readouterr().out)
    out = tmp_path / "m"
    assert summary["outtype"] == "Q4_K_M" and summary["write_s"] >= 0 and summary["tensor_types"]["Q6_K"] >= 1
    assert sorted(p.name for p in out.iterdir()) == ["clef-gguf.json", "joint_head.safetensors",
                                                      "joint_head_config.json", "tokenizer.json",
                                                      "tower-Q4_K_M.gguf"]
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging or intermediate left behind
    reader = open_gguf(out / "tower-Q4_K_M.gguf")
    assert field_value(reader, "general.architecture") == "qwen35"
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q4_K", "F32"}
    with Clef.load(out, threads=1) as clef:
        answer = clef.decide({"state": "Invoice 7 is late.", "questions": {"late": {"type": "noul"}}})
    assert 0.0 <= answer["answers"]["late"]["noul"] <= 1.0
    assert json.loads((out / "clef-gguf.json").read_text())["source"]["random_weights"] is True


def test_refuses_a_large_tensor_that_needs_edits(monkeypatch, tmp_path):
    """Row blocks are only for plain matrices: a table change that would draw an edited tensor
    in blocks fails before the file exists."""
    monkeypatch.setattr(big, "CHUNK_ELEMENTS", 16)
    with pytest.raises(ConversionError, match="too large to draw at once"):
        big.write_random_tower(tmp_path / "x.gguf", preset="tiny", outtype="bf16")
    assert list(tmp_path.iterdir()) == []


def test_vision_adds_a_flash_shaped_vision_tower_that_answers_pictures(tmp_path, capsys, monkeypatch):
    """``--vision``: the vision files beside the tower, hashed in the manifest, read by the runtime. The
    blocks are cut to 2 here (the real 27 write 0.9 GB); the widths, patches and processors are Flash's."""
    from clef_gguf.runtime.model import Clef
    from clef_gguf.tools.workload import with_picture

    monkeypatch.setitem(big.FLASH_VISION, "depth", 2)
    assert big.main([str(tmp_path / "m"), "--preset", "tiny256", "--outtype", "f32", "--vision"]) == 0
    summary = json.loads(capsys.readouterr().out)
    out = tmp_path / "m"
    assert summary["vision_s"] >= 0
    config = json.loads((out / "vision_config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["patch_size"]) == (1152, 4304, 16)
    assert config["out_hidden_size"] == 256  # the tower's width
    manifest = json.loads((out / "clef-gguf.json").read_text())
    assert {"vision.safetensors", "vision_config.json"} <= set(manifest["files"])
    request = with_picture({"state": "What is in the picture?", "questions": {"q": {"type": "noul"}}}, 448)
    with Clef.load(out, threads=1) as clef:
        prepared = clef.prepare(request)
        answer, timings = clef.run(prepared)
        pad = clef.encoder.tokenizer.token_to_id("<|image_pad|>")
    assert int((prepared.encoded.ids == pad).sum()) == 196  # 448 x 448 at 32 x 32 pixels a token
    assert 0.0 <= answer["answers"]["q"]["noul"] <= 1.0 and timings["vision"] > 0
