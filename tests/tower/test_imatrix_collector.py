"""``clef-gguf imatrix``: llama-imatrix's statistic over decision prompts, in its GGUF format.

The statistic is checked against numpy for blk.0's input projections (their input is the RMS-normed
token embeddings, computable exactly from the GGUF); the file against llama.cpp's save format, our
reader (``convert/imatrix_file.py``) and llama.cpp's quantizer; the refusals name their flag and line.
"""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest

from clef_gguf import Clef
from clef_gguf.cli import main
from clef_gguf.convert import imatrix_file as im
from clef_gguf.tower import imatrix_collector as ic
from clef_gguf.convert import quantize as qz
from clef_gguf.convert.samples import SAMPLE_REQUESTS
from clef_gguf.core import errors
from clef_gguf.formats.files import from_directory
from clef_gguf.formats.finetune_files import ADAPTER_MANIFEST
from clef_gguf.formats.gguf import field_value, open_gguf
from clef_gguf.pipeline.encode import Encoder
from clef_gguf.pipeline.request import parse_request

REQUEST = SAMPLE_REQUESTS[0]


def _ids(model_dir, request=REQUEST) -> np.ndarray:
    return Encoder.from_file(from_directory(model_dir).tokenizer).encode(parse_request(request)).ids


def _collect(model_dir, prompts, adapter=None) -> ic.Collected:
    with ic.Collector(from_directory(model_dir).tower, n_ctx=max(map(len, prompts)), threads=1) as c:
        if adapter is not None:
            c.use_adapter(adapter)
        for ids in prompts:
            c.add(ids)
        return c.result()


def _records(path, requests, extra_lines=()) -> str:
    lines = [json.dumps({"id": f"r{i}", **r, "labels": {}}) for i, r in enumerate(requests)]
    path.write_text("\n".join([*lines, *extra_lines]) + "\n")
    return str(path)


def _imatrix(argv, capsys) -> tuple[int, dict]:
    rc = main(["imatrix", *argv])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def test_the_ggml_tensor_layout_is_this_librarys():
    op = ic.check_layout()
    assert ic._op_name(op) == b"MUL_MAT"
    assert ic.weight_name(b"CUDA0#blk.3.ffn_up.weight#0") == "blk.3.ffn_up.weight"
    assert ic.weight_name(b"blk.3.ffn_up.weight") == "blk.3.ffn_up.weight"
    assert ic.collected("blk.0.attn_qkv.weight")
    assert not any(map(ic.collected, ("blk.0.attn_qkv.weight.lora_a", "output.weight", "cache_k_l3")))


def test_statistics_are_the_squares_of_each_weights_input(tiny_model_dir):
    ids = _ids(tiny_model_dir)
    result = _collect(tiny_model_dir, [ids])
    assert (result.prompts, result.tokens) == (1, len(ids))
    tensors = {t.name: t for t in open_gguf(from_directory(tiny_model_dir).tower).tensors}
    matmuls = {name for name, t in tensors.items() if ic.collected(name) and len(t.shape) == 2
               and "ssm_conv1d" not in name}  # the short convolution is no matmul
    assert set(result.sums) == matmuls
    assert set(result.counts.values()) == {len(ids)}  # one row per decoded token, every weight
    assert all(np.isfinite(s).all() and (s > 0).all() for s in result.sums.values())

    # blk.0's linear-attention projections all read attn_norm(token embeddings): exactly computable.
    reader = open_gguf(from_directory(tiny_model_dir).tower)
    eps = float(field_value(reader, "qwen35.attention.layer_norm_rms_epsilon"))
    x = np.asarray(tensors["token_embd.weight"].data, dtype=np.float64)[ids]
    norm = np.asarray(tensors["blk.0.attn_norm.weight"].data, dtype=np.float64)
    h = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps) * norm
    expected = (h * h).sum(axis=0)
    for name in ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta"):
        np.testing.assert_allclose(result.sums[f"blk.0.{name}.weight"], expected, rtol=2e-5)


def test_prompts_add_up_and_each_is_decoded_from_scratch(tiny_model_dir):
    a, b = _ids(tiny_model_dir), _ids(tiny_model_dir, SAMPLE_REQUESTS[1])
    both, alone_a, alone_b = _collect(tiny_model_dir, [a, b]), _collect(tiny_model_dir, [a]), \
        _collect(tiny_model_dir, [b])
    assert both.prompts == 2 and both.counts["blk.3.ffn_down.weight"] == len(a) + len(b)
    for name, sums in both.sums.items():
        np.testing.assert_allclose(sums, alone_a.sums[name] + alone_b.sums[name], rtol=1e-5)


def test_cli_writes_llama_imatrix_gguf_that_quantizes(tiny_model_dir, tmp_path, capsys):
    data = _records(tmp_path / "records.jsonl", SAMPLE_REQUESTS)
    out = tmp_path / "clef.imatrix"
    rc, summary = _imatrix(["--model", str(tiny_model_dir), "--data", data, "--output", str(out),
                            "--threads", "1"], capsys)
    assert rc == 0 and summary["prompts"] == 4 and summary["entries"] == 31
    # imatrix.cpp save_imatrix: these keys and no architecture; per weight in name order, in_sum2
    # [ne0, 1] then counts [1, 1], F32.
    reader = gguf.GGUFReader(out)
    assert [k for k in reader.fields if not k.startswith("GGUF.")] == [
        "general.type", "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"]
    assert field_value(reader, "general.type") == "imatrix"
    assert list(reader.fields["imatrix.datasets"].contents()) == [data]
    assert reader.fields["imatrix.chunk_count"].contents() == 4
    names = sorted({t.name.rsplit(".", 1)[0] for t in reader.tensors})
    assert [t.name for t in reader.tensors] == [f"{n}.{s}" for n in names for s in ("in_sum2", "counts")]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    counts = {t.name: t for t in reader.tensors}
    assert [int(x) for x in counts["blk.0.ffn_down.weight.in_sum2"].shape] == [128, 1]
    assert float(counts["blk.0.ffn_down.weight.counts"].data[0, 0]) == summary["tokens"]

    direct = _collect(tiny_model_dir, [_ids(tiny_model_dir, r) for r in SAMPLE_REQUESTS])
    m = im.read(out)  # the quantizer's reader: sum / count per column
    assert set(m.entries) == set(direct.sums) and m.chunks == 4
    for name, sums in direct.sums.items():
        np.testing.assert_allclose(m.entries[name], sums / direct.counts[name], rtol=1e-6)

    # llama.cpp uses the weights (IQ2_M falls back to IQ4_NL at width 64: same files otherwise).
    ours = qz.quantize_model(tiny_model_dir, tmp_path / "iq2", "IQ2_M", imatrix=out, threads=1)
    flat = qz.quantize_model(tiny_model_dir, tmp_path / "flat", "IQ2_M", imatrix=im.UNIFORM, threads=1)
    assert (ours / "tower-IQ2_M.gguf").read_bytes() != (flat / "tower-IQ2_M.gguf").read_bytes()
    with Clef.load(ours, threads=1) as clef:
        answers = clef.decide(REQUEST)["answers"]
    assert set(answers) == set(REQUEST["questions"]) and 0 <= answers["overdue"]["noul"] <= 1


def test_a_fine_tunes_activations_through_its_adapter(tiny_model_dir, tiny_fine_tunes, tmp_path, capsys):
    ids = _ids(tiny_model_dir)
    base = _collect(tiny_model_dir, [ids])
    data = _records(tmp_path / "r.jsonl", [REQUEST])
    rc, summary = _imatrix(["--model", str(tiny_model_dir), "--data", data, "--adapter",
                            str(tiny_fine_tunes["a"]), "--output", str(tmp_path / "a.imatrix")], capsys)
    assert rc == 0 and summary["adapter"] == "a"
    tuned = im.read(tmp_path / "a.imatrix").entries
    # Layer 0 reads the embeddings (no LoRA before it); the last layers read the adapted stream.
    np.testing.assert_allclose(tuned["blk.0.attn_qkv.weight"], base.sums["blk.0.attn_qkv.weight"] / len(ids),
                               rtol=1e-5)
    assert not np.allclose(tuned["blk.3.ffn_down.weight"], base.sums["blk.3.ffn_down.weight"] / len(ids),
                           rtol=1e-3)
    assert not any(".lora" in name for name in tuned)

    other = tmp_path / "other-base"  # the same fine-tune, its manifest saying another depth
    shutil.copytree(tiny_fine_tunes["a"], other)
    manifest = json.loads((other / ADAPTER_MANIFEST).read_text())
    manifest["base"]["n_layer"] = 5
    (other / ADAPTER_MANIFEST).write_text(json.dumps(manifest))
    rc, err = _imatrix(["--model", str(tiny_model_dir), "--data", data, "--adapter", str(other),
                        "--output", str(tmp_path / "b.imatrix")], capsys)
    assert rc == 1 and err["error"]["code"] == "adapter_mismatch" and "n_layer 5" in err["error"]["message"]
    assert not (tmp_path / "b.imatrix").exists()


def test_refusals_name_the_flag_and_the_line(tiny_model_dir, tiny_model_dir_factory, tmp_path, capsys):
    out = str(tmp_path / "m.imatrix")
    model = ["--model", str(tiny_model_dir)]
    bad = _records(tmp_path / "bad.jsonl", SAMPLE_REQUESTS[:2],
                   ['{"state": "x", "questions": {"q": {"type": "maybe"}}}'])
    rc, err = _imatrix([*model, "--data", bad, "--output", out], capsys)
    assert rc == 2 and err["error"]["field"] == "data"
    assert "bad.jsonl line 3" in err["error"]["message"] and "invalid_question_type" in err["error"]["message"]
    (tmp_path / "json.jsonl").write_text('{"state": "x"\n')
    rc, err = _imatrix([*model, "--data", str(tmp_path / "json.jsonl"), "--output", out], capsys)
    assert rc == 2 and "json.jsonl line 1" in err["error"]["message"]
    (tmp_path / "empty.jsonl").write_text("\n\n")
    rc, err = _imatrix([*model, "--data", str(tmp_path / "empty.jsonl"), "--output", out], capsys)
    assert rc == 2 and "holds no records" in err["error"]["message"]
    rc, err = _imatrix([*model, "--data", str(tmp_path / "missing.jsonl"), "--output", out], capsys)
    assert rc == 2 and err["error"]["field"] == "data" and "not found" in err["error"]["message"]
    media = _records(tmp_path / "media.jsonl", [{**REQUEST, "images": ["data:image/png;base64,AAAA"]}])
    rc, err = _imatrix([*model, "--data", media, "--output", out], capsys)
    assert rc == 2 and "line 1 has images" in err["error"]["message"]

    good = _records(tmp_path / "good.jsonl", [REQUEST])
    rc, err = _imatrix(["--model", str(tiny_model_dir_factory("q8_0")), "--data", good, "--output", out], capsys)
    assert err["error"]["field"] == "model" and "quantized" in err["error"]["message"]
    assert not (tmp_path / "m.imatrix").exists()
    (tmp_path / "m.imatrix").write_bytes(b"keep")
    rc, err = _imatrix([*model, "--data", good, "--output", out], capsys)
    assert rc == 2 and err["error"]["field"] == "output" and "--force" in err["error"]["message"]
    assert (tmp_path / "m.imatrix").read_bytes() == b"keep"
    rc, summary = _imatrix([*model, "--data", good, "--output", out, "--force"], capsys)
    assert rc == 0 and im.read(out).chunks == 1


@pytest.mark.slow
def test_types_that_need_an_imatrix_take_ours(tmp_path, capsys):
    """Width 256: IQ2_M's IQ2_S tensors really need the matrix (refused without it, made with it)."""
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.synthetic.tiny import build_release

    base = convert_release(build_release(tmp_path / "release", preset="tiny256"), tmp_path / "f32", outtype="f32")
    data = _records(tmp_path / "r.jsonl", SAMPLE_REQUESTS[:2])
    rc, _ = _imatrix(["--model", str(base), "--data", data, "--output", str(tmp_path / "m.imatrix")], capsys)
    assert rc == 0
    with pytest.raises(errors.ConversionError, match="needs an importance matrix"):
        qz.quantize_model(base, tmp_path / "none", "IQ2_M", threads=1)
    out = qz.quantize_model(base, tmp_path / "iq2m", "IQ2_M", imatrix=tmp_path / "m.imatrix", threads=1)
    types = qz.tensor_types(out / "tower-IQ2_M.gguf")["tensor_types"]
    assert types.get("IQ2_S", 0) > 0
    with Clef.load(out, threads=1) as clef:
        assert set(clef.decide(REQUEST)["answers"]) == set(REQUEST["questions"])
