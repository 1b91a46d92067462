"""``clef-gguf convert split``: a native-clef GGUF (llama.cpp arch ``clef``, head inside) -> tower + head.

The native files are written here from the tiny release the way upstream's ``conversion/clef.py``
does it (its own copy of upstream's name map, block renumbering, q/k/v chunking and scalar folding),
deliberately independent of ``convert/split.py``'s tables, so a wrong table entry fails a test.
"""

from __future__ import annotations

import argparse
import json
import math
import re

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from clef_gguf import Clef
from clef_gguf.formats import files
from clef_gguf.convert.split import add_split_arguments, run_split, split_native
from clef_gguf.core.errors import ConversionError, ModelNotFound
from clef_gguf.heads import load_head

Q8_0, BF16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16

# gguf-py tensor_mapping.py, the ``# clef`` entries (module names; {bid} after renumbering).
UPSTREAM_MAP = {
    "joint_head.hidden_norm": "decision.hidden_norm",
    "joint_head.memory_projection": "decision.proj_memory",
    "joint_head.question_projection": "decision.proj_question",
    "joint_head.option_question_projection": "decision.proj_option_question",
    "joint_head.global_projection": "decision.proj_global",
    "joint_head.option_context_projection": "decision.proj_option_context",
    "joint_head.option_lexical_projection": "decision.proj_option_lexical",
    "joint_head.type_embedding": "token_types",
    "joint_head.option_summary_norm": "decision.option_summary_norm",
    "joint_head.field_norm": "decision.field_norm",
    "joint_head.option_norm": "decision.option_norm",
    "joint_head.residual_scorer.0": "decision.scorer",
    "joint_head.residual_scorer.3": "decision.scorer_out",
    "joint_head.layers.{bid}.norm1": "dec.blk.{bid}.attn_norm",
    "joint_head.layers.{bid}.self_attn.q": "dec.blk.{bid}.attn_q",
    "joint_head.layers.{bid}.self_attn.k": "dec.blk.{bid}.attn_k",
    "joint_head.layers.{bid}.self_attn.v": "dec.blk.{bid}.attn_v",
    "joint_head.layers.{bid}.self_attn.out_proj": "dec.blk.{bid}.attn_o",
    "joint_head.layers.{bid}.norm2": "dec.blk.{bid}.cross_attn_norm",
    "joint_head.layers.{bid}.multihead_attn.q": "dec.blk.{bid}.cross_attn_q",
    "joint_head.layers.{bid}.multihead_attn.k": "dec.blk.{bid}.cross_attn_k",
    "joint_head.layers.{bid}.multihead_attn.v": "dec.blk.{bid}.cross_attn_v",
    "joint_head.layers.{bid}.multihead_attn.out_proj": "dec.blk.{bid}.cross_attn_o",
    "joint_head.layers.{bid}.norm3": "dec.blk.{bid}.ffn_norm",
    "joint_head.layers.{bid}.linear1": "dec.blk.{bid}.ffn_up",
    "joint_head.layers.{bid}.linear2": "dec.blk.{bid}.ffn_down",
    "joint_head.evidence_layers.{bid}.query_norm": "dec.blk.{bid}.cross_attn_norm",
    "joint_head.evidence_layers.{bid}.memory_norm": "dec.blk.{bid}.cross_attn_norm_kv",
    "joint_head.evidence_layers.{bid}.attention.q": "dec.blk.{bid}.cross_attn_q",
    "joint_head.evidence_layers.{bid}.attention.k": "dec.blk.{bid}.cross_attn_k",
    "joint_head.evidence_layers.{bid}.attention.v": "dec.blk.{bid}.cross_attn_v",
    "joint_head.evidence_layers.{bid}.attention.out_proj": "dec.blk.{bid}.cross_attn_o",
    "joint_head.evidence_layers.{bid}.feedforward_norm": "dec.blk.{bid}.ffn_norm",
    "joint_head.evidence_layers.{bid}.feedforward.0": "dec.blk.{bid}.ffn_up",
    "joint_head.evidence_layers.{bid}.feedforward.3": "dec.blk.{bid}.ffn_down",
}
# The older revision (clef.cpp without the eps key) stored the scorer as the classifier tensors.
LEGACY = {"decision.scorer": "cls", "decision.scorer_out": "cls.output"}

REQUESTS = [
    {"state": {"ticket": "Refund not received after 14 days", "amount": 129.5},
     "questions": {
         "urgent": {"type": "noul", "instructions": "Is this urgent?"},
         "team": {"type": "choice", "instructions": "Which team?",
                  "criteria": {"billing": "Payments and refunds", "tech": None, "sales": "New deals"}},
         "anger": {"type": "score", "instructions": "How angry is the customer?",
                   "criteria": ["calm", "annoyed", "furious"]}}},
    {"state": "The build failed twice on main; the flaky test is test_io.",
     "questions": {"flaky": {"type": "noul"},
                   "area": {"type": "choice", "criteria": {"ci": "CI", "code": "Code", "infra": None}}}},
    {"state": "Très bien, merci 😀", "questions": {
        "mood": {"type": "score", "instructions": "Mood", "criteria": ["bad", "ok", "good", "great"]}}},
]


def _upstream_name(name: str) -> str:
    """``TensorNameMap.get_name`` with the .weight/.bias suffixes tried, over UPSTREAM_MAP."""
    base, suffix = name.rsplit(".", 1)
    for pattern, target in UPSTREAM_MAP.items():
        m = re.fullmatch(re.escape(pattern).replace(r"\{bid\}", r"(\d+)"), base)
        if m:
            return (target.replace("{bid}", m.group(1)) if m.groups() else target) + "." + suffix
    raise KeyError(name)


def upstream_head(state: dict, routing: int, *, legacy: bool = False):
    """``ClefModel.modify_tensors`` over the release head: yields (GGUF name, float32 array)."""
    scales = {}
    for name, data in state.items():
        parts = ("joint_head." + name).split(".")
        if len(parts) == 2 and data.ndim == 0:  # learned scalars, folded in float64
            value = float(data)
            scales[parts[1]] = (1.0 / (1.0 + math.exp(-value)) if parts[1] == "residual_gate"
                                else math.exp(min(value, math.log(100.0))))
            if len(scales) == 3:
                yield "decision.scales", np.array(
                    [scales[k] for k in ("prior_logit_scale", "joint_logit_scale", "residual_gate")],
                    dtype=np.float32)
            continue
        if parts[1] == "layers":
            parts[2] = str(int(parts[2]) + routing)
        name = ".".join(parts)
        chunks = [(name, data)]
        for suffix in ("weight", "bias"):
            if name.endswith(".in_proj_" + suffix):
                prefix = name[:-len("in_proj_" + suffix)]
                chunks = [(prefix + x + "." + suffix, c) for x, c in zip("qkv", data.chunk(3, dim=0))]
        for n, c in chunks:
            out = _upstream_name(n)
            if legacy:
                module, p = out.rsplit(".", 1)
                out = LEGACY.get(module, module) + "." + p
            yield out, c.float().numpy()


def _copy_field(writer: gguf.GGUFWriter, key: str, field) -> None:
    main = field.types[0]
    sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(key, field.contents(), main, sub_type=sub)


def write_native(model_dir, path, *, legacy=False, store="f32", drop=(), keys=None, replace=None):
    """A clef-arch GGUF from a converted tiny model dir: tower + head in upstream's layout.

    ``store``: "f32", or "mixed" like the published Q4_K_M (head matrices Q8_0, scorer_out bf16 and
    1-D as llama-quantize leaves it). ``drop``: tensor names left out. ``keys``: edits of the decision
    keys (None deletes). ``replace``: name -> array to store instead.
    """
    manifest = files.read_manifest(model_dir)
    reader = gguf.GGUFReader(model_dir / manifest["tower"])
    config = json.loads((model_dir / files.HEAD_CONFIG).read_text())
    writer = gguf.GGUFWriter(path, "clef")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        _copy_field(writer, "clef." + key[len("qwen35."):] if key.startswith("qwen35.") else key, field)
    decision = {"clef.decision.type": ("clef", gguf.GGUFValueType.STRING),
                "clef.decision.routing_block_count": (config["routing_layers"], gguf.GGUFValueType.UINT32),
                "clef.decision.block_count": (config["layers"], gguf.GGUFValueType.UINT32),
                "clef.decision.head_count": (config["heads"], gguf.GGUFValueType.UINT32),
                "clef.decision.temperature.choice": (1.0, gguf.GGUFValueType.FLOAT32)}
    if not legacy:
        decision["clef.attention.layer_norm_epsilon"] = (1e-5, gguf.GGUFValueType.FLOAT32)
    for key, value in (keys or {}).items():
        if value is None:
            decision.pop(key, None)
        else:
            decision[key] = value
    for key, (value, vtype) in decision.items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    state = load_file(str(model_dir / files.HEAD_WEIGHTS))
    for name, data in upstream_head(state, config["routing_layers"], legacy=legacy):
        if name in drop:
            continue
        data = (replace or {}).get(name, data)
        if store == "mixed" and name == "decision.scorer_out.weight":
            writer.add_tensor(name, gguf.quants.quantize(data.reshape(-1), BF16), raw_dtype=BF16)
        elif store == "mixed" and data.ndim == 2 and data.shape[1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(data, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tower(model_dir) -> gguf.GGUFReader:
    return gguf.GGUFReader(model_dir / files.read_manifest(model_dir)["tower"])


def _head_state(model_dir) -> dict:
    head = load_head(model_dir / files.HEAD_CONFIG, model_dir / files.HEAD_WEIGHTS)
    return head.state_dict()


def _assert_tower_identical(original: gguf.GGUFReader, split: gguf.GGUFReader) -> None:
    a = {t.name: t for t in original.tensors}
    b = {t.name: t for t in split.tensors}
    assert list(a) == list(b)  # same tensors, same order, no head tensor left behind
    for name, t in a.items():
        u = b[name]
        assert u.tensor_type == t.tensor_type, name
        assert u.shape.tolist() == t.shape.tolist(), name
        assert np.asarray(u.data).tobytes() == np.asarray(t.data).tobytes(), name


def _assert_decides_alike(original_dir, split_dir) -> None:
    with Clef.load(original_dir, max_length=2048, threads=2) as a, \
            Clef.load(split_dir, max_length=2048, threads=2) as b:
        for request in REQUESTS:
            assert b.decide(request)["answers"] == a.decide(request)["answers"]
            for pa, pb in zip(a.probabilities(request), b.probabilities(request), strict=True):
                np.testing.assert_allclose(pb, pa, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def native_f32(tiny_model_dir, tmp_path_factory):
    return write_native(tiny_model_dir, tmp_path_factory.mktemp("native") / "clef-tiny-f32.gguf")


@pytest.fixture(scope="module")
def split_f32(native_f32, tiny_model_dir, tmp_path_factory):
    return split_native(native_f32, tmp_path_factory.mktemp("split"),
                        tokenizer=tiny_model_dir / files.TOKENIZER)


def test_tower_is_copied_byte_for_byte(tiny_model_dir, split_f32):
    _assert_tower_identical(_tower(tiny_model_dir), _tower(split_f32))


def test_keys_renamed_and_decision_keys_dropped(tiny_model_dir, split_f32):
    original, split = _tower(tiny_model_dir), _tower(split_f32)
    assert split.fields["general.architecture"].contents() == "qwen35"
    keys = [k for k in split.fields if not k.startswith("GGUF.")]
    assert not [k for k in keys if k.startswith("clef.") or ".decision." in k]
    assert "qwen35.attention.layer_norm_epsilon" not in keys  # the head's eps is no tower key
    for key, field in original.fields.items():
        if not key.startswith("GGUF."):
            assert split.fields[key].contents() == field.contents(), key
    assert set(keys) == {k for k in original.fields if not k.startswith("GGUF.")}


def test_head_is_the_release_head(tiny_model_dir, split_f32):
    assert json.loads((split_f32 / files.HEAD_CONFIG).read_text()) == \
        json.loads((tiny_model_dir / files.HEAD_CONFIG).read_text())
    want, got = _head_state(tiny_model_dir), _head_state(split_f32)
    assert list(got) == list(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    manifest = files.read_manifest(split_f32)
    assert manifest["outtype"] == "f32" and manifest["tower"] == "tower-f32.gguf"
    assert manifest["source"]["format"] == "native-clef-gguf"
    assert "clef.decision.head_count" in manifest["source"]["dropped_keys"]


def test_split_model_decides_like_the_original(tiny_model_dir, split_f32):
    _assert_decides_alike(tiny_model_dir, split_f32)


def test_older_naming_is_accepted(tiny_model_dir, tmp_path):
    native = write_native(tiny_model_dir, tmp_path / "legacy.gguf", legacy=True)
    out = split_native(native, tmp_path / "out", tokenizer=tiny_model_dir / files.TOKENIZER)
    want, got = _head_state(tiny_model_dir), _head_state(out)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_quantized_head_is_dequantized(tiny_model_dir, tmp_path):
    native = write_native(tiny_model_dir, tmp_path / "mixed.gguf", store="mixed")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(native).tensors}
    assert types["decision.proj_memory.weight"] == Q8_0 and types["decision.scorer_out.weight"] == BF16
    out = split_native(native, tmp_path / "out", tokenizer=tiny_model_dir / files.TOKENIZER)
    want, got = _head_state(tiny_model_dir), _head_state(out)
    assert got["residual_scorer.3.weight"].shape == want["residual_scorer.3.weight"].shape
    torch.testing.assert_close(got["residual_scorer.3.weight"], want["residual_scorer.3.weight"])
    for name, tensor in want.items():
        # Q8_0: per 32 values the error is at most 0.5625 * amax / 127 (rounding plus the f16 scale).
        bound = 0.5625 * tensor.abs().max().item() / 127 + 1e-6
        assert (got[name] - tensor).abs().max().item() <= bound, name
    with Clef.load(out, max_length=2048, threads=2) as model:
        answers = model.decide(REQUESTS[0])["answers"]
    assert list(answers) == ["urgent", "team", "anger"]


def test_quantized_tower_keeps_its_bytes(tiny_model_dir_factory, tmp_path):
    q8 = tiny_model_dir_factory("q8_0")
    native = write_native(q8, tmp_path / "q8.gguf")
    out = split_native(native, tmp_path / "out", tokenizer=q8 / files.TOKENIZER)
    original, split = _tower(q8), _tower(out)
    assert any(t.tensor_type == Q8_0 for t in split.tensors)
    _assert_tower_identical(original, split)
    assert files.read_manifest(out)["tower"] == "tower-q8_0.gguf"
    _assert_decides_alike(q8, out)


@pytest.mark.parametrize("theta", [-7.5, -2.0, 0.0, 1.7, math.log(100.0), 6.0])
def test_scalar_unfolding_round_trips(theta):
    from clef_gguf.convert.split import SCALAR_TABLE

    folded = np.float32([math.exp(min(theta, math.log(100.0))), 1 / (1 + math.exp(-theta))])
    prior = SCALAR_TABLE[0][2](float(folded[0]))
    gate = SCALAR_TABLE[2][2](float(folded[1]))
    # Same multipliers as the reference formula (the clamp makes θ > ln 100 indistinguishable).
    assert math.exp(min(prior, math.log(100.0))) == pytest.approx(float(folded[0]), rel=1e-6)
    assert torch.sigmoid(torch.tensor(gate)).item() == pytest.approx(float(folded[1]), rel=1e-6)
    if theta <= math.log(100.0):
        assert prior == pytest.approx(theta, abs=1e-6)
    assert gate == pytest.approx(theta, abs=1e-5)


def test_without_tokenizer_it_is_rebuilt_and_the_manifest_written(native_f32, tmp_path):
    (tmp_path / files.MANIFEST).write_text("{}")  # a stale manifest must not survive
    split_native(native_f32, tmp_path)
    assert files.read_manifest(tmp_path)["source"]["tokenizer"] == "gguf"
    assert {p.name for p in tmp_path.iterdir()} == {
        "tower-f32.gguf", files.HEAD_WEIGHTS, files.HEAD_CONFIG, files.TOKENIZER, files.MANIFEST}


def test_cli_entry_points(native_f32, tiny_model_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_split_arguments(parser)
    args = parser.parse_args([str(native_f32), str(tmp_path / "out"),
                              "--tokenizer", str(tiny_model_dir / files.TOKENIZER), "--head-dtype", "bf16"])
    assert run_split(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["manifest"] and summary["outtype"] == "f32"
    assert summary["calibration"] is None  # temperature.choice = 1.0 changes nothing: no file
    assert load_file(str(tmp_path / "out" / files.HEAD_WEIGHTS))["hidden_norm.weight"].dtype == torch.bfloat16


# --------------------------------------------------------------------------- upstream temperatures

F32 = gguf.GGUFValueType.FLOAT32
TEMPERATURES = {"clef.decision.temperature.choice": (2.0, F32),
                "clef.decision.temperature.noul.2": (0.5, F32),
                "clef.decision.temperature.score.3_5": (1.0, F32)}


def test_upstream_temperatures_are_kept_as_a_calibration_file(tiny_model_dir, tmp_path, capsys):
    from clef_gguf.pipeline.answer import split_probabilities
    from clef_gguf.cli import main
    from clef_gguf.formats.calibration import Calibration

    native = write_native(tiny_model_dir, tmp_path / "t.gguf", keys=TEMPERATURES)
    parser = argparse.ArgumentParser()
    add_split_arguments(parser)
    out = tmp_path / "out"
    assert run_split(parser.parse_args([str(native), str(out), "--tokenizer",
                                        str(tiny_model_dir / files.TOKENIZER)])) == 0
    summary = json.loads(capsys.readouterr().out)
    manifest = files.read_manifest(out)
    assert summary["calibration"] == manifest["calibration"]
    assert manifest["calibration"]["file"] == "calibration.json"
    assert manifest["files"]["calibration.json"]["size"] == (out / "calibration.json").stat().st_size
    cal = Calibration.load(out / "calibration.json")
    assert cal.version == manifest["calibration"]["version"]
    assert cal.temperatures == {"choice": 2.0, "noul.2": 0.5, "score.3_5": 1.0}
    assert cal.body["bound_to"]["tower_sha256"] == manifest["files"]["tower-f32.gguf"]["sha256"]
    # Bound to the split files (a load would refuse it otherwise) and applied as upstream does.
    request = REQUESTS[0]
    with Clef.load(out, max_length=2048, threads=2) as plain, \
            Clef.load(out, max_length=2048, threads=2, calibration=out / "calibration.json") as tempered:
        logits = plain.logits(plain.prepare(request).encoded)
        got = tempered.probabilities(request)
        assert tempered.decide(request)["audit"]["calibration_version"] == cal.version
    want = split_probabilities(logits, (2, 3, 3), (0.5, 2.0, 1.0))  # noul, choice, score
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    path = tmp_path / "request.json"
    path.write_text(json.dumps(request))
    assert main(["decide", "--model", str(out), "-r", str(path), "--threads", "1",
                 "--calibration", str(out / "calibration.json")]) == 0
    assert json.loads(capsys.readouterr().out)["audit"]["calibration_version"] == cal.version


def test_temperatures_of_one_keep_the_directory_as_it_was(tiny_model_dir, tmp_path):
    keys = {k: (1.0, F32) for k in TEMPERATURES}
    out = split_native(write_native(tiny_model_dir, tmp_path / "t.gguf", keys=keys), tmp_path / "out",
                       tokenizer=tiny_model_dir / files.TOKENIZER)
    assert not (out / "calibration.json").exists() and "calibration" not in files.read_manifest(out)


def test_refuses_temperatures_it_cannot_apply(tiny_model_dir, tmp_path):
    cases = [({"clef.decision.temperature.choice.7": (2.0, F32)}, "temperature.choice.7"),
             ({"clef.decision.temperature.ranking": (2.0, F32)}, "temperature.ranking"),
             ({"clef.decision.temperature.noul": (0.0, F32)}, "must be a number"),
             ({"clef.decision.temperature.noul": (float("nan"), F32)}, "must be a number")]
    for i, (keys, match) in enumerate(cases):
        case = tmp_path / str(i)
        case.mkdir()
        _refused(write_native(tiny_model_dir, case / "n.gguf", keys=keys), case, match)


# --------------------------------------------------------------------------- refusals

def _refused(native, tmp_path, match):
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=match):
        split_native(native, out)
    assert not out.exists() or not any(out.iterdir())  # nothing half-written


def test_refuses_a_file_that_is_not_clef(tiny_model_dir, tmp_path):
    _refused(tiny_model_dir / "tower-f32.gguf", tmp_path, "architecture 'qwen35'")


def test_refuses_missing_files(tmp_path, native_f32):
    with pytest.raises(ModelNotFound):
        split_native(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(ModelNotFound):
        split_native(native_f32, tmp_path / "out", tokenizer=tmp_path / "nope.json")


@pytest.mark.parametrize("drop, match", [
    ("decision.proj_global.weight", "decision.proj_global.weight"),
    ("dec.blk.3.cross_attn_k.bias", "dec.blk.3.cross_attn_k.bias"),
    ("decision.scales", "decision.scales"),
    ("decision.proj_memory.weight", "decision.proj_memory.weight"),
])
def test_refuses_missing_decision_tensors(tiny_model_dir, tmp_path, drop, match):
    _refused(write_native(tiny_model_dir, tmp_path / "n.gguf", drop={drop}), tmp_path, re.escape(match))


def test_refuses_shapes_that_do_not_fit(tiny_model_dir, tmp_path):
    width = json.loads((tiny_model_dir / files.HEAD_CONFIG).read_text())["width"]
    bad = {"decision.option_norm.weight": np.ones(width + 1, dtype=np.float32)}
    _refused(write_native(tiny_model_dir, tmp_path / "n.gguf", replace=bad), tmp_path, "shape")


def test_refuses_bad_keys_and_values(tiny_model_dir, tmp_path):
    u32 = gguf.GGUFValueType.UINT32
    cases = [
        ({"keys": {"clef.decision.routing_block_count": (3, u32)}}, "dec.blk.2.cross_attn_norm_kv"),
        ({"keys": {"clef.decision.head_count": None}}, "head_count"),
        ({"keys": {"clef.decision.head_count": (5, u32)}}, "divisible"),
        ({"keys": {"clef.decision.type": ("laya", gguf.GGUFValueType.STRING)}}, "laya"),
        ({"keys": {"clef.attention.layer_norm_epsilon": (1e-6, gguf.GGUFValueType.FLOAT32)}}, "eps"),
        ({"replace": {"decision.scales": np.float32([-1.0, 1.0, 0.5])}}, "exp"),
        ({"replace": {"decision.scales": np.float32([1.0, 1.0, 1.5])}}, "sigmoid"),
    ]
    for i, (edit, match) in enumerate(cases):
        case = tmp_path / str(i)
        case.mkdir()
        _refused(write_native(tiny_model_dir, case / "n.gguf", **edit), case, match)


def test_refuses_an_extra_head_tensor(tiny_model_dir, tmp_path):
    native = write_native(tiny_model_dir, tmp_path / "n.gguf")
    # One decoder block more than the keys say: the block is in the head's namespace but unused.
    reader = gguf.GGUFReader(native)
    writer = gguf.GGUFWriter(tmp_path / "extra.gguf", "clef")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            _copy_field(writer, key, field)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.add_tensor("dec.blk.9.ffn_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _refused(tmp_path / "extra.gguf", tmp_path, "unexpected head tensor")
