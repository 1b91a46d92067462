"""HF release -> qwen35 GGUF: metadata, vocab, tensor edits, error paths, and tower parity with transformers."""

from __future__ import annotations

import json
import shutil
import unicodedata

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from clef_gguf.formats import files
from clef_gguf.convert.hf_to_gguf import write_tower
from clef_gguf.convert.release import convert_release
from clef_gguf.core.errors import ConversionError, ModelNotFound

PARITY_TEXTS = [
    "<|im_start|>user\nIs this message spam? {\"state\": \"Win a free cruise now!!!\"}<|im_end|>",
    "The quick brown fox jumps over the lazy dog. Résumé 中文 😀 <think>x</think> 42",
]
V_TILES = frozenset({"tile_v_rows_of_qkv", "tile_v_rows", "tile_v_heads", "tile_v_cols"})


def _fields(path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items()}


def _tensors(path) -> dict:
    r = gguf.GGUFReader(path)
    return {t.name: t for t in r.tensors}


def _as_f32(t) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)


def _hf(release, name) -> torch.Tensor:
    with safe_open(str(release / "model.safetensors"), framework="pt") as fh:
        return fh.get_tensor(name).float()


def _copy(release, tmp_path):
    return shutil.copytree(release, tmp_path / "src")


def _prompts(release) -> list[np.ndarray]:
    tok = Tokenizer.from_file(str(release / "tokenizer.json"))
    ids = [np.array(tok.encode(t).ids, dtype=np.int32) for t in PARITY_TEXTS]
    rng = np.random.default_rng(7)  # a longer prompt: the recurrent state and RoPE over 300 positions
    ids.append(rng.integers(0, tok.get_vocab_size(), size=300).astype(np.int32))
    return ids


def _errors(gguf_path, release, hf_hidden) -> tuple[float, float]:
    """(max |a-b|, max |a-b| / max |b|) over the parity prompts, llama.cpp vs transformers."""
    from clef_gguf.tower.llama_tower import Tower

    abs_err, scale = 0.0, 0.0
    with Tower.load(gguf_path, n_ctx=512, threads=2) as tower:
        for ids in _prompts(release):
            got, ref = tower.hidden_states(ids), hf_hidden(ids)
            abs_err, scale = max(abs_err, float(np.abs(got - ref).max())), max(scale, float(np.abs(ref).max()))
    return abs_err, abs_err / scale


# --------------------------------------------------------------------------- file layout

def test_model_dir_layout_and_manifest(tiny_model_dir, tiny_release):
    manifest = files.read_manifest(tiny_model_dir)
    assert manifest["tower"] == "tower-f32.gguf" and manifest["outtype"] == "f32"
    assert manifest["source"]["random_weights"] is True
    assert manifest["source"]["skipped_tensors"] > 0  # vision + MTP
    mf = files.from_directory(tiny_model_dir)
    assert mf.name == "clef-tiny-random"
    for role in ("head_weights", "head_config", "tokenizer"):
        assert getattr(mf, role).read_bytes() == (tiny_release / getattr(mf, role).name).read_bytes()
    assert not list(tiny_model_dir.glob("*.partial"))


def test_metadata(tiny_model_dir, tiny_release):
    cfg = json.loads((tiny_release / "config.json").read_text())["text_config"]
    f = _fields(tiny_model_dir / "tower-f32.gguf")
    assert f["general.architecture"] == "qwen35" and f["general.file_type"] == 0
    expect = {"block_count": 4, "embedding_length": cfg["hidden_size"],
              "feed_forward_length": cfg["intermediate_size"],
              "context_length": cfg["max_position_embeddings"],
              "attention.head_count": cfg["num_attention_heads"],
              "attention.head_count_kv": cfg["num_key_value_heads"],
              "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
              "rope.dimension_count": 8, "ssm.conv_kernel": 4,
              "ssm.state_size": cfg["linear_key_head_dim"],
              "ssm.group_count": cfg["linear_num_key_heads"],
              "ssm.time_step_rank": cfg["linear_num_value_heads"],
              "ssm.inner_size": cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"],
              "full_attention_interval": 4}
    for key, value in expect.items():
        assert f[f"qwen35.{key}"] == value, key
    sections = f["qwen35.rope.dimension_sections"]
    assert len(sections) == 4 and sum(sections) == f["qwen35.rope.dimension_count"] // 2
    assert f["qwen35.attention.recurrent_layers"] == [True, True, True, False]
    assert f["qwen35.rope.freq_base"] == pytest.approx(cfg["rope_parameters"]["rope_theta"])
    assert f["qwen35.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)


def test_vocab_is_padded_and_typed(tiny_model_dir, tiny_release):
    f = _fields(tiny_model_dir / "tower-f32.gguf")
    spec = json.loads((tiny_release / "tokenizer.json").read_text())
    n_vocab = json.loads((tiny_release / "config.json").read_text())["text_config"]["vocab_size"]
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "qwen35"
    assert len(tokens) == len(types) == n_vocab
    for text, i in spec["model"]["vocab"].items():
        assert tokens[i] == text and types[i] == gguf.TokenType.NORMAL
    added = {t["id"]: t for t in spec["added_tokens"]}
    for i, t in added.items():
        assert tokens[i] == t["content"]
        assert types[i] == (gguf.TokenType.CONTROL if t["special"] else gguf.TokenType.USER_DEFINED)
    first_pad = max(added) + 1
    assert tokens[first_pad] == f"[PAD{first_pad}]" and tokens[-1] == f"[PAD{n_vocab - 1}]"
    assert set(types[first_pad:]) == {gguf.TokenType.UNUSED}
    assert len(f["tokenizer.ggml.merges"]) == len(spec["model"]["merges"])
    ids = {t["content"]: t["id"] for t in spec["added_tokens"]}
    assert f["tokenizer.ggml.eos_token_id"] == ids["<|im_end|>"]
    assert f["tokenizer.ggml.padding_token_id"] == ids["<|endoftext|>"]
    assert f["tokenizer.ggml.add_bos_token"] is False


def test_llama_tokenizer_agrees_with_tokenizers(tiny_model_dir, tiny_release):
    import llama_cpp as ll

    from clef_gguf.tower.llama import ensure_backend

    ensure_backend()  # llama.cpp's log to ours, its backend initialised

    tok = Tokenizer.from_file(str(tiny_release / "tokenizer.json"))
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(str(tiny_model_dir / "tower-f32.gguf").encode(), params)
    assert model
    try:
        vocab, buf = ll.llama_model_get_vocab(model), (ll.llama_token * 1024)()
        for text in PARITY_TEXTS + ["tabs\tand\n\nnewlines   x", "naïve café 12345 ... !!"]:
            # llama.cpp applies no NFC; the runtime feeds it ids from `tokenizers` anyway.
            data = unicodedata.normalize("NFC", text).encode()
            n = ll.llama_tokenize(vocab, data, len(data), buf, 1024, False, True)
            assert list(buf[:n]) == tok.encode(text).ids, text
    finally:
        ll.llama_model_free(model)


# --------------------------------------------------------------------------- tensors

def test_tensor_set_skips_vision_and_mtp(tiny_model_dir):
    names = set(_tensors(tiny_model_dir / "tower-f32.gguf"))
    assert not any(("visual" in n) or ("mtp" in n) or ("nextn" in n) or n.startswith("blk.4") for n in names)
    assert {"token_embd.weight", "output.weight", "output_norm.weight", "blk.3.attn_q.weight",
            "blk.0.attn_qkv.weight", "blk.0.ssm_a", "blk.0.ssm_dt.bias"} <= names
    assert len(names) == 3 + 3 * 15 + 8


def test_tensor_edits(tiny_model_dir, tiny_release):
    t = _tensors(tiny_model_dir / "tower-f32.gguf")
    lm = "model.language_model.layers."
    nk, nv, hd = 2, 4, 16

    def tiled(x: torch.Tensor, head: int) -> torch.Tensor:
        # independent statement of the order llama.cpp wants: new head h <- old head (h % nk) * (nv // nk) + h // nk
        order = [(h % nk) * (nv // nk) + h // nk for h in range(nv)]
        return torch.cat([x[o * head:(o + 1) * head] for o in order])

    def check(gguf_name: str, expected: torch.Tensor, exact: bool = True) -> None:
        got, want = _as_f32(t[gguf_name]), expected.numpy()
        if exact:
            np.testing.assert_array_equal(got, want, err_msg=gguf_name)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=gguf_name)

    def hf(name: str) -> torch.Tensor:
        return _hf(tiny_release, lm + name)

    check("blk.0.attn_norm.weight", hf("0.input_layernorm.weight") + 1)
    check("blk.3.attn_q_norm.weight", hf("3.self_attn.q_norm.weight") + 1)
    check("output_norm.weight", _hf(tiny_release, "model.language_model.norm.weight") + 1)
    check("blk.0.ssm_norm.weight", hf("0.linear_attn.norm.weight"))
    check("blk.0.ssm_a", -torch.exp(tiled(hf("0.linear_attn.A_log"), 1)), exact=False)
    check("blk.0.ssm_dt.bias", tiled(hf("0.linear_attn.dt_bias"), 1))
    check("blk.0.ssm_beta.weight", tiled(hf("0.linear_attn.in_proj_b.weight"), 1))
    check("blk.0.attn_gate.weight", tiled(hf("0.linear_attn.in_proj_z.weight"), hd))
    qkv = hf("0.linear_attn.in_proj_qkv.weight")
    check("blk.0.attn_qkv.weight", torch.cat([qkv[:2 * nk * hd], tiled(qkv[2 * nk * hd:], hd)]))
    check("blk.0.ssm_out.weight", tiled(hf("0.linear_attn.out_proj.weight").T, hd).T)
    conv = hf("0.linear_attn.conv1d.weight")[:, 0, :]
    check("blk.0.ssm_conv1d.weight", torch.cat([conv[:2 * nk * hd], tiled(conv[2 * nk * hd:], hd)]))
    check("blk.3.attn_q.weight", hf("3.self_attn.q_proj.weight"))
    check("output.weight", _hf(tiny_release, "lm_head.weight"))

@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_storage_types(tiny_model_dir_factory, outtype):
    main = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[outtype]
    path = tiny_model_dir_factory(outtype) / f"tower-{outtype}.gguf"
    types = {n: t.tensor_type.name for n, t in _tensors(path).items()}
    for name, kind in types.items():
        keep_f32 = name.endswith(("_norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight"))
        assert kind == ("F32" if keep_f32 else main), name
    assert _fields(path)["general.file_type"] == int(
        {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
         "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype])


def test_sharded_release_converts_identically(tiny_model_dir, tmp_path):
    from clef_gguf.convert.synthetic.tiny import build_release

    src = build_release(tmp_path / "sharded", preset="tiny", seed=0, shards=3)
    out = convert_release(src, tmp_path / "out", name="clef-tiny-random")
    assert (out / "tower-f32.gguf").read_bytes() == (tiny_model_dir / "tower-f32.gguf").read_bytes()


def test_flat_causal_lm_release(tiny_release, tiny_model_dir, tmp_path):
    """A text-only Qwen3_5ForCausalLM checkpoint (flat config, ``model.`` prefix) gives the same tower."""
    src = _copy(tiny_release, tmp_path)
    text = json.loads((src / "config.json").read_text())["text_config"]
    (src / "config.json").write_text(json.dumps({**text, "architectures": ["Qwen3_5ForCausalLM"]}))
    tensors = load_file(str(src / "model.safetensors"))
    flat = {k.replace("model.language_model.", "model."): v for k, v in tensors.items() if "visual" not in k}
    save_file(flat, str(src / "model.safetensors"))
    out = convert_release(src, tmp_path / "out", name="clef-tiny-random")
    a, b = _tensors(out / "tower-f32.gguf"), _tensors(tiny_model_dir / "tower-f32.gguf")
    assert a.keys() == b.keys()
    assert all(np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data)) for n in a)


# --------------------------------------------------------------------------- errors

def _mutate_weights(src, fn):
    tensors = load_file(str(src / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(src / "model.safetensors"))


def _mutate_config(src, fn):
    cfg = json.loads((src / "config.json").read_text())
    fn(cfg)
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case, error, match", [
    ("no_config", ModelNotFound, "no config.json"),
    ("bad_json", ConversionError, "not valid JSON"),
    ("arch", ConversionError, "unsupported architecture"),
    ("missing_tensor", ConversionError, r"missing 1 tensor.*layers\.2\.linear_attn\.A_log"),
    ("unknown_tensor", ConversionError, "unknown tensor"),
    ("stray_prefix", ConversionError, "unknown tensor 'encoder.weight'"),
    ("wrong_layer_kind", ConversionError, "unexpected tensor"),
    ("shape", ConversionError, "has shape"),
    ("no_weights", ModelNotFound, r"no model\*\.safetensors"),
    ("corrupt_weights", ConversionError, "cannot read model.safetensors"),
    ("no_tokenizer", ModelNotFound, "tokenizer.json"),
    ("no_head", ModelNotFound, "joint_head.safetensors"),
    ("head_hidden", ConversionError, "hidden_size"),
    ("mrope", ConversionError, "must sum to n_rot/2"),
    ("small_vocab", ConversionError, "vocab_size"),
    ("kv_dims", ConversionError, "linear_key_head_dim must equal"),
])
def test_conversion_errors(tiny_release, tmp_path, case, error, match):
    src = _copy(tiny_release, tmp_path)
    lm = "model.language_model."
    if case == "no_config":
        (src / "config.json").unlink()
    elif case == "bad_json":
        (src / "config.json").write_text("{")
    elif case == "arch":
        _mutate_config(src, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    elif case == "missing_tensor":
        _mutate_weights(src, lambda t: t.pop(lm + "layers.2.linear_attn.A_log"))
    elif case == "unknown_tensor":
        _mutate_weights(src, lambda t: t.update({lm + "layers.0.mlp.extra.weight": torch.zeros(2)}))
    elif case == "stray_prefix":
        _mutate_weights(src, lambda t: t.update({"encoder.weight": torch.zeros(2)}))
    elif case == "wrong_layer_kind":
        _mutate_weights(src, lambda t: t.update({lm + "layers.3.linear_attn.A_log": torch.zeros(4)}))
    elif case == "shape":
        _mutate_weights(src, lambda t: t.update({lm + "norm.weight": torch.zeros(65)}))
    elif case == "no_weights":
        (src / "model.safetensors").unlink()
    elif case == "corrupt_weights":
        (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    elif case == "no_tokenizer":
        (src / "tokenizer.json").unlink()
    elif case == "no_head":
        (src / files.HEAD_WEIGHTS).unlink()
    elif case == "head_hidden":
        cfg = json.loads((src / files.HEAD_CONFIG).read_text())
        (src / files.HEAD_CONFIG).write_text(json.dumps({**cfg, "hidden_size": 128}))
    elif case == "mrope":
        _mutate_config(src, lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[11, 11, 10]))
    elif case == "small_vocab":
        def shrink(t):
            for name in (lm + "embed_tokens.weight", "lm_head.weight"):
                t[name] = t[name][:500].clone()
        _mutate_config(src, lambda c: c["text_config"].update(vocab_size=500))
        _mutate_weights(src, shrink)
    elif case == "kv_dims":
        _mutate_config(src, lambda c: c["text_config"].update(linear_value_head_dim=32))
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        convert_release(src, out)
    assert not list(out.glob("*.gguf")) and not list(out.glob("*.partial"))


def test_unknown_outtype(tiny_release, tmp_path):
    with pytest.raises(ConversionError, match="unknown outtype"):
        convert_release(tiny_release, tmp_path / "out", outtype="q4_k")


# --------------------------------------------------------------------------- parity with transformers

def test_tower_parity_f32(tiny_model_dir, tiny_release, tiny_hf_hidden):
    abs_err, rel = _errors(tiny_model_dir / "tower-f32.gguf", tiny_release, tiny_hf_hidden)
    print(f"\nf32 tower vs transformers: max abs {abs_err:.3g}, max rel {rel:.3g}")
    assert rel <= 1e-3, (abs_err, rel)


# The tiny random network amplifies weight noise ~10x (transformers itself moves ~14% max-rel when
# its weights are rounded through q8_0), so these bounds are loose; f32 above is the real check.
@pytest.mark.parametrize("outtype, bound", [("f16", 2e-2), ("bf16", 0.1), ("q8_0", 0.35)])
def test_tower_parity_quantized(tiny_model_dir_factory, tiny_release, tiny_hf_hidden, outtype, bound):
    path = tiny_model_dir_factory(outtype) / f"tower-{outtype}.gguf"
    abs_err, rel = _errors(path, tiny_release, tiny_hf_hidden)
    print(f"\n{outtype} tower vs transformers: max abs {abs_err:.3g}, max rel {rel:.3g}")
    assert rel <= bound, (abs_err, rel)


@pytest.mark.parametrize("skip", [V_TILES, frozenset({"plus_one"}), frozenset({"neg_exp"})],
                         ids=["no-v-head-tiling", "no-norm-plus-one", "no-neg-exp"])
def test_parity_check_catches_a_missing_edit(tiny_release, tiny_hf_hidden, tmp_path, skip):
    """Each tensor edit matters at the 1e-3 bar: leaving one out fails the parity test by far."""
    bad = tmp_path / "bad.gguf"
    write_tower(tiny_release, bad, outtype="f32", _skip_edits=skip)
    _, rel = _errors(bad, tiny_release, tiny_hf_hidden)
    assert rel > 0.05, rel


# --------------------------------------------------------------------------- CLI

def test_cli_convert_and_demo(tiny_release, tmp_path, capsys):
    from clef_gguf.cli import main

    assert main(["convert", str(tiny_release), str(tmp_path / "conv"), "--outtype", "q8_0", "--name", "x"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tower"].endswith("tower-q8_0.gguf")
    assert files.read_manifest(tmp_path / "conv")["name"] == "x"

    assert main(["demo", str(tmp_path / "demo"), "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert "RANDOM WEIGHTS" in captured.err and "RANDOM WEIGHTS" in json.loads(captured.out)["warning"]
    mf = files.from_directory(tmp_path / "demo")
    assert mf.tower.name == "tower-f32.gguf" and (tmp_path / "demo" / "release" / "config.json").is_file()


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_conversion_leaves_no_half_directory(tiny_release, tmp_path, monkeypatch, existing):
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "keep.txt").write_text("mine")

    def fail(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(files, "write_manifest", fail)  # after the tower and the head files
    with pytest.raises(OSError, match="disk full"):
        convert_release(tiny_release, out)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["out"] if existing else [])  # no staging directory left either
    if existing:
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
