"""``convert --keep-layers``: kept decoder layers written wider by llama.cpp's real quantizer.

The tiny model (4 layers, hidden 64) goes through the CLI as a user runs it; a 12-layer, hidden-256
variant of ``tiny256`` (every K-quant block fits, and enough layers for the Q4_K_M mix to vary by
layer) checks that the layers not kept are byte for byte the plain quantization's and that a kept
layer never loses bits the mix gave it. Every refusal runs through the CLI: exit 2, before any work.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from clef_gguf import Clef
from clef_gguf.cli import main
from clef_gguf.convert import keep_layers as kl
from clef_gguf.convert import quantize as qz
from clef_gguf.convert.release import convert_release
from clef_gguf.core.errors import InvalidSetting
from clef_gguf.formats import files
from clef_gguf.formats.gguf import open_gguf

REQUEST = {"state": {"ticket": "Refund not received after 14 days"},
           "questions": {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
                         "team": {"type": "choice", "criteria": {"billing": None, "tech": None}}}}


def _types(model_dir) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in open_gguf(files.from_directory(model_dir).tower).tensors}


def _layer(name: str) -> int | None:
    found = re.match(r"blk\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def _convert(capsys, *argv) -> tuple[int, dict]:
    rc = main(["convert", *map(str, argv)])
    return rc, json.loads(capsys.readouterr().out)


# --------------------------------------------------------------------------- the flag itself

def test_ranges_and_types_parse_and_name_themselves():
    keep = kl.parse(["0-3, 30-31 = q8_0", "4=Q8_0", "10=f16", "2=Q8_0"])  # same type twice: fine
    assert keep is not None and keep.layers == {**dict.fromkeys([0, 1, 2, 3, 4, 30, 31], "Q8_0"), 10: "F16"}
    assert keep.rules() == [{"layers": "0-4,30-31", "type": "Q8_0"}, {"layers": "10", "type": "F16"}]
    assert keep.label() == "0-4,30-31=q8_0,10=f16"
    assert kl.parse(None) is None and kl.parse([]) is None


def test_every_base_type_is_a_quant_type_and_every_quant_has_one():
    assert set(kl.BASE_TYPE) == set(qz.QUANT_TYPES)
    assert kl.bits_per_weight("Q8_0") == 8.5 and kl.bits_per_weight("Q4_K") == 4.5


# --------------------------------------------------------------------------- tiny model, CLI

@pytest.fixture(scope="module")
def tiny_quants(tiny_model_dir, tmp_path_factory):
    """The tiny f32 model as plain Q4_K_M and as Q4_K_M with layers 0-1 kept at Q8_0 (the CLI)."""
    work = tmp_path_factory.mktemp("keep-tiny")
    for out, extra in (("plain", []), ("kept", ["--keep-layers", "0-1=Q8_0"])):
        assert main(["convert", str(tiny_model_dir), str(work / out), "--outtype", "Q4_K_M", *extra]) == 0
    return work / "plain", work / "kept"


def test_kept_layers_are_q8_0_and_the_rest_is_the_q4_k_m_mix(tiny_quants):
    plain, kept = map(_types, tiny_quants)
    assert plain.keys() == kept.keys()
    quantized = {n for n, t in plain.items() if t != "F32"}  # what llama.cpp quantizes at all
    assert {n for n in quantized if _layer(n) in (0, 1)}  # the test is not empty
    for name, kind in kept.items():
        if _layer(name) in (0, 1) and name in quantized:
            assert kind == "Q8_0", name
        else:  # norms, ssm_conv1d, the other layers, token_embd, output: the plain mix
            assert kind == plain[name], name
    assert {plain[n] for n in quantized if _layer(n) in (0, 1)} - {"Q8_0"}  # some got wider


def test_manifest_gguf_and_audit_record_it(tiny_quants, capsys):
    plain, kept = tiny_quants
    quant = files.read_manifest(kept)["source"]["quantization"]
    assert quant["keep_layers"] == [{"layers": "0-1", "type": "Q8_0", "tensors": {"Q8_0": 16, "F32": 2}}]
    assert "keep_layers" not in files.read_manifest(plain)["source"]["quantization"]
    tower = open_gguf(files.from_directory(kept).tower)
    assert tower.fields[kl.GGUF_KEY].contents() == "0-1=q8_0"
    for model, precision in ((plain, "q4_k_m"), (kept, "q4_k_m+keep[0-1=q8_0]")):
        with Clef.load(model, max_length=512, threads=1) as clef:
            out = clef.decide(REQUEST)
            assert out["audit"]["precision"] == precision and clef.info["quant"] == precision
            assert 0 <= out["answers"]["urgent"]["noul"] <= 1
            assert abs(sum(out["answers"]["team"]["probabilities"].values()) - 1) < 2e-4


def test_q8_0_keeps_layers_in_f16_through_llama_cpp(tiny_release, tmp_path, capsys):
    """Our writer's q8_0 cannot mix types; with --keep-layers q8_0 goes through llama.cpp's Q8_0
    (byte-identical to ours), from a release as from a converted directory."""
    rc, summary = _convert(capsys, tiny_release, tmp_path / "q8", "--outtype", "q8_0", "--keep-layers", "3=f16")
    assert rc == 0 and summary["tower"].endswith("tower-q8_0.gguf")
    types = _types(tmp_path / "q8")
    assert {types[n] for n in types if _layer(n) == 3 and types[n] != "F32"} == {"F16"}
    assert {types[n] for n in types if _layer(n) in (0, 1, 2) and types[n] != "F32"} == {"Q8_0"}
    manifest = files.read_manifest(tmp_path / "q8")
    assert manifest["outtype"] == "q8_0"
    assert manifest["source"]["quantization"]["keep_layers"][0]["layers"] == "3"
    with Clef.load(tmp_path / "q8", max_length=512, threads=1) as clef:
        assert clef.decide(REQUEST)["audit"]["precision"] == "q8_0+keep[3=f16]"


# --------------------------------------------------------------------------- 12 layers: the mix

@pytest.fixture(scope="module")
def deep_f32(tmp_path_factory):
    from clef_gguf.convert.synthetic import tiny

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny.PRESETS, "deep", dict(tiny.PRESETS["tiny256"], layers=12))
        release = tiny.build_release(tmp_path_factory.mktemp("deep-release"), preset="deep")
    return convert_release(release, tmp_path_factory.mktemp("deep-f32"), outtype="f32")


def test_layers_not_kept_are_the_plain_quantization_byte_for_byte(deep_f32, tmp_path):
    """llama.cpp places its mix by counting tensors, and an overridden tensor is not counted: kept
    layers 0-3 must not shift layers 4-11 (the dry run + every-tensor overrides see to it). Q5_K is
    narrower than the Q6_K the mix gives attn_v and some ffn_down: those stay Q6_K."""
    plain = qz.quantize_model(deep_f32, tmp_path / "plain", "Q4_K_M", threads=2)
    kept = qz.quantize_model(deep_f32, tmp_path / "kept", "Q4_K_M", keep_layers=["0-3=Q5_K"], threads=2)
    a = {t.name: t for t in open_gguf(plain / "tower-Q4_K_M.gguf").tensors}
    b = {t.name: t for t in open_gguf(kept / "tower-Q4_K_M.gguf").tensors}
    assert {t.tensor_type.name for n, t in a.items() if (_layer(n) or 0) >= 4} >= {"Q4_K", "Q6_K"}
    raised = held = 0
    for name, t in a.items():
        if _layer(name) is not None and _layer(name) < 4 and t.tensor_type.name != "F32":
            want = "Q6_K" if t.tensor_type.name == "Q6_K" else "Q5_K"
            assert b[name].tensor_type.name == want, name
            raised, held = raised + (want == "Q5_K"), held + (want == "Q6_K")
        else:
            assert b[name].tensor_type == t.tensor_type, name
            assert np.array_equal(np.asarray(b[name].data), np.asarray(t.data)), name
    assert raised and held


# --------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("outtype, values, problem", [
    ("Q4_K_M", ["a-b=Q8_0"], "'a-b' is not a layer or a range"),
    ("Q4_K_M", ["7-0=Q8_0"], "range 7-0 ends before it starts"),
    ("Q4_K_M", ["=Q8_0"], "expected RANGE=TYPE"),
    ("Q4_K_M", [""], "expected RANGE=TYPE"),
    ("Q4_K_M", ["0-1"], "expected RANGE=TYPE"),
    ("Q4_K_M", ["0,,1=Q8_0"], "'(empty)' is not a layer"),
    ("Q4_K_M", ["4=Q8_0"], "layer 4 does not exist: the model has 4 decoder layers (0-3)"),
    ("Q4_K_M", ["0=Q9_0"], "unknown TYPE 'Q9_0'"),
    ("Q4_K_M", ["0=TQ1_0"], "unknown TYPE 'TQ1_0'"),
    ("Q4_K_M", ["0-1=Q4_0"], "Q4_0 is not wider than Q4_K_M's Q4_K"),
    ("Q4_K_M", ["0-1=Q3_K"], "Q3_K is not wider than Q4_K_M's Q4_K"),
    ("q8_0", ["0=Q6_K"], "Q6_K is not wider than q8_0's Q8_0"),
    ("Q4_K_M", ["0-3=Q8_0", "2=f16"], "layer 2 is already kept at Q8_0"),
    ("f16", ["0=f32"], "needs a quantized --outtype"),
    ("f32", ["0=Q8_0"], "needs a quantized --outtype"),
])
def test_refusals_name_the_flag_before_any_work(tiny_model_dir, tiny_release, tmp_path, capsys,
                                                outtype, values, problem):
    flags = [a for v in values for a in ("--keep-layers", v)]
    for src in (tiny_model_dir, tiny_release):  # a converted directory, and a release (config.json)
        rc, out = _convert(capsys, src, tmp_path / "out", "--outtype", outtype, *flags)
        assert rc == 2, out
        error = out["error"]
        assert error["code"] == "invalid_setting" and error["field"] == "keep_layers"
        assert "--keep-layers" in error["message"] and problem in error["message"], error["message"]
        assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_the_python_api_refuses_the_same(tiny_model_dir, tmp_path):
    with pytest.raises(InvalidSetting, match="layer 9 does not exist"):
        qz.quantize_model(tiny_model_dir, tmp_path / "x", "Q4_K_M", keep_layers=["9=Q8_0"])
    with pytest.raises(InvalidSetting, match="not wider"):
        qz.quantize_file(files.from_directory(tiny_model_dir).tower, tmp_path / "x.gguf", "Q6_K",
                         keep_layers=["0=Q5_K"])
    assert list(tmp_path.iterdir()) == []


def test_nvfp4_refuses_it_like_the_other_quantizer_flags(tiny_release, tmp_path, capsys):
    rc, out = _convert(capsys, tiny_release, tmp_path / "n", "--outtype", "nvfp4a16", "--keep-layers", "0=f16")
    assert rc == 1 and "--keep-layers" in out["error"]["message"]
