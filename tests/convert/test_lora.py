"""PEFT LoRA -> llama.cpp adapter GGUF (``convert.lora``): metadata, names, shapes, the V-head
reordering proven numerically against a merged release, every refusal, merged-release provenance."""

from __future__ import annotations

import ctypes
import json
import math
import shutil
from pathlib import Path

import gguf
import llama_cpp as ll
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from clef_gguf.formats import files
from clef_gguf.convert.synthetic.finetune_demo import build_finetune_checkpoint
from clef_gguf.convert.lora import EDIT_SIDE, convert_adapter
from clef_gguf.convert.release import convert_release
from clef_gguf.convert.synthetic.tiny import build_release
from clef_gguf.core.errors import AdapterMismatch, ConversionError, CorruptModel, HeadMismatch, ModelNotFound
from clef_gguf.formats.finetune_files import AdapterFiles, read_adapter_manifest
from clef_gguf.tower.llama import ensure_backend, extra_buffer_types

PREFIX = "base_model.model.model.language_model."
V_TILES = frozenset(EDIT_SIDE)


@pytest.fixture(scope="module")
def checkpoint(tiny_release, tmp_path_factory) -> Path:
    return build_finetune_checkpoint(tiny_release, tmp_path_factory.mktemp("ft") / "checkpoint-10")


def _copy_ckpt(checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))


def _edit_config(ckpt: Path, **changes) -> None:
    path = ckpt / "adapter" / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}))


def _edit_tensors(ckpt: Path, fn) -> None:
    path = ckpt / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


# --------------------------------------------------------------------------- llama.cpp, raw

def _hidden(tower: Path, ids: np.ndarray, adapter: Path | None = None) -> np.ndarray:
    """Post-norm hidden states of one prompt through llama.cpp, optionally with a LoRA applied."""
    ensure_backend()
    params = ll.llama_model_default_params()
    # The runtime's choice (tower/llama.py): on an AMX CPU, llama.cpp's AMX-repacked Q8_0 weights
    # segfault decoding with a LoRA applied, so the runtime loads without extra buffer types there.
    params.use_extra_bufts = extra_buffer_types()
    model = ll.llama_model_load_from_file(str(tower).encode(), params)
    assert model
    lora = None
    cp = ll.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = 1
    cp.n_threads = cp.n_threads_batch = 2
    cp.embeddings = True
    cp.pooling_type = ll.LLAMA_POOLING_TYPE_NONE
    ctx = ll.llama_init_from_model(model, cp)
    try:
        assert ctx
        if adapter is not None:
            lora = ll.llama_adapter_lora_init(model, str(adapter).encode())
            assert lora, f"llama.cpp refused {adapter}"
            ptrs = (ll.llama_adapter_lora_p_ctypes * 1)(lora)
            scales = (ctypes.c_float * 1)(1.0)
            assert ll.llama_set_adapters_lora(ctx, ptrs, 1, scales) == 0
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        batch = ll.llama_batch_get_one(ids.ctypes.data_as(ctypes.POINTER(ll.llama_token)), len(ids))
        assert ll.llama_decode(ctx, batch) == 0
        n_embd = ll.llama_model_n_embd(model)
        return np.ctypeslib.as_array(ll.llama_get_embeddings(ctx), shape=(len(ids), n_embd)).copy()
    finally:
        if ctx:
            ll.llama_free(ctx)
        if lora:
            ll.llama_adapter_lora_free(lora)
        ll.llama_model_free(model)


def _prompt(n: int = 200) -> np.ndarray:
    return np.random.default_rng(3).integers(0, 500, size=n).astype(np.int32)


def _merge(release: Path, ckpt: Path, out: Path, scales: dict[str, float] | None = None) -> Path:
    """The release with W + scale * B @ A merged in, in float32 (PEFT's merge_and_unload, by hand)."""
    shutil.copytree(release, out)
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    lora = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    weights = {k: v.float() for k, v in load_file(str(release / "model.safetensors")).items()}
    for name, a in lora.items():
        if ".lora_A." not in name:
            continue
        module = name[len("base_model.model."):-len(".lora_A.weight")]
        b = lora[name.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0]
        scale = (scales or {}).get(module.rsplit(".", 1)[-1])
        if scale is None:
            scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
        weights[module + ".weight"] += scale * (b.double() @ a.double()).float()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# --------------------------------------------------------------------------- the file

def test_adapter_gguf_metadata_names_and_shapes(checkpoint, tiny_model_dir, tmp_path):
    out = convert_adapter(checkpoint, tmp_path / "ft", base=tiny_model_dir, outtype="f32")
    reader = gguf.GGUFReader(out / "adapter-f32.gguf")
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta["general.type"] == "adapter" and meta["adapter.type"] == "lora"
    assert meta["general.architecture"] == "qwen35" and meta["adapter.lora.alpha"] == 16.0
    base = {t.name: list(t.shape) for t in gguf.GGUFReader(tiny_model_dir / "tower-f32.gguf").tensors}
    tensors = {t.name: list(t.shape) for t in reader.tensors}
    assert len(tensors) == 2 * 31  # 3 GDN layers x 8 projections + 1 attention layer x 7
    for name, ne in tensors.items():
        target, side = name.rsplit(".", 1)
        assert target in base and side in ("lora_a", "lora_b")
        if side == "lora_a":  # llama.cpp: model ne[0] == a ne[0], model ne[1] == b ne[1], a ne[1] == b ne[0]
            assert ne == [base[target][0], 8]
        else:
            assert ne == [8, base[target][1]]
    assert {n.rsplit(".", 2)[0].split(".", 2)[2] for n in tensors} == {
        "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out", "ffn_gate", "ffn_up", "ffn_down",
        "attn_q", "attn_k", "attn_v", "attn_output"}


def test_manifest_contract(checkpoint, tiny_model_dir, tmp_path):
    out = convert_adapter(checkpoint, tmp_path / "ft", base=tiny_model_dir, outtype="f16", name="mine")
    manifest = read_adapter_manifest(out)
    base = files.read_manifest(tiny_model_dir)
    assert manifest["format"] == "clef-gguf-adapter/1" and manifest["name"] == "mine"
    assert manifest["adapter"] == "adapter-f16.gguf"
    assert manifest["base"] == {"name": base["name"], "tower": "tower-f32.gguf",
                                "tower_sha256": base["files"]["tower-f32.gguf"]["sha256"],
                                "architecture": "qwen35", "n_embd": 64, "n_layer": 4, "n_vocab": 640}
    assert manifest["lora"] == {"rank": 8, "alpha": 16.0, "targets": 31, "outtype": "f16"}
    assert manifest["source"]["tool"] == "clef-finetune"
    assert manifest["source"]["train_config"]["lora"]["r"] == 8
    assert manifest["source"]["base_model"] == str(Path(json.loads(
        (checkpoint / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]))
    for fname, entry in manifest["files"].items():
        assert entry == {"sha256": files.sha256_file(out / fname), "size": (out / fname).stat().st_size}
    assert (out / "joint_head_config.json").read_bytes() == (tiny_model_dir / "joint_head_config.json").read_bytes()
    head = load_file(str(out / "joint_head.safetensors"))
    source = load_file(str(checkpoint / "joint_head.safetensors"))
    assert head.keys() == source.keys() and all(v.dtype == torch.float32 for v in head.values())
    assert all(torch.equal(head[k], source[k]) for k in head)
    found = AdapterFiles.from_directory(out)
    assert found.adapter == out / "adapter-f16.gguf" and found.sha256["adapter-f16.gguf"] == \
        manifest["files"]["adapter-f16.gguf"]["sha256"]


# The tiny random network amplifies weight rounding (see test_convert's quantized parity bounds).
@pytest.mark.parametrize("outtype, a_type, b_type, bound", [
    ("f16", "F16", "F16", 5e-3), ("bf16", "BF16", "BF16", 3e-2),
    ("q8_0", "Q8_0", "F16", 0.1),  # B's rows are rank 8 long: not a whole q8_0 block, f16 instead
])
def test_storage_types(checkpoint, tiny_model_dir, tmp_path, outtype, a_type, b_type, bound):
    out = convert_adapter(checkpoint, tmp_path / "ft", base=tiny_model_dir, outtype=outtype)
    types = {t.name.rsplit(".", 1)[1]: t.tensor_type.name
             for t in gguf.GGUFReader(out / f"adapter-{outtype}.gguf").tensors}
    assert types == {"lora_a": a_type, "lora_b": b_type}
    exact = convert_adapter(checkpoint, tmp_path / "f32", base=tiny_model_dir, outtype="f32")
    ids, tower = _prompt(64), tiny_model_dir / "tower-f32.gguf"
    want = _hidden(tower, ids, exact / "adapter-f32.gguf")
    got = _hidden(tower, ids, out / f"adapter-{outtype}.gguf")
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"\n{outtype} adapter vs f32 adapter: max rel {rel:.3g}")
    assert rel < bound


# --------------------------------------------------------------------------- numbers

def test_adapter_matches_the_merged_release(checkpoint, tiny_release, tiny_model_dir, tmp_path):
    """base GGUF + adapter == the release with B @ A merged, converted: the V-head reordering of
    B's rows and A's columns is the tower converter's; leaving it out breaks the match by far."""
    merged = convert_release(_merge(tiny_release, checkpoint, tmp_path / "merged-src"), tmp_path / "merged")
    ids = _prompt()
    want = _hidden(merged / "tower-f32.gguf", ids)
    base = _hidden(tiny_model_dir / "tower-f32.gguf", ids)
    ft = convert_adapter(checkpoint, tmp_path / "ft", base=tiny_model_dir, outtype="f32")
    got = _hidden(tiny_model_dir / "tower-f32.gguf", ids, ft / "adapter-f32.gguf")
    err, moved = float(np.abs(got - want).max()), float(np.abs(base - want).max())
    print(f"\nadapter vs merged: max |dh| {err:.3g} (the fine-tune moves it by {moved:.3g})")
    assert err < 1e-3 * moved and moved > 0.1
    bad = convert_adapter(checkpoint, tmp_path / "bad", base=tiny_model_dir, outtype="f32",
                          _skip_edits=V_TILES)
    wrong = _hidden(tiny_model_dir / "tower-f32.gguf", ids, bad / "adapter-f32.gguf")
    assert float(np.abs(wrong - want).max()) > 0.05 * moved
    f16 = convert_adapter(checkpoint, tmp_path / "f16", base=tiny_model_dir, outtype="f16")
    close = _hidden(tiny_model_dir / "tower-f32.gguf", ids, f16 / "adapter-f16.gguf")
    assert float(np.abs(close - want).max()) < 1e-2 * moved


@pytest.mark.parametrize("settings", [
    {"alpha_pattern": {"in_proj_qkv": 4, "down_proj": 40}},
    {"use_rslora": True},
], ids=["alpha-pattern", "rslora"])
def test_per_module_scales_are_folded_into_b(checkpoint, tiny_release, tiny_model_dir, tmp_path, settings):
    ckpt = _copy_ckpt(checkpoint, tmp_path)
    _edit_config(ckpt, **settings)
    scales = {k: v / 8 for k, v in settings.get("alpha_pattern", {}).items()}
    merged = convert_release(_merge(tiny_release, ckpt, tmp_path / "merged-src", scales), tmp_path / "merged")
    ft = convert_adapter(ckpt, tmp_path / "ft", base=tiny_model_dir, outtype="f32")
    assert read_adapter_manifest(ft)["lora"]["alpha"] == 0.0  # llama.cpp then scales by 1
    ids = _prompt(64)
    want = _hidden(merged / "tower-f32.gguf", ids)
    got = _hidden(tiny_model_dir / "tower-f32.gguf", ids, ft / "adapter-f32.gguf")
    assert float(np.abs(got - want).max()) < 1e-3 * float(np.abs(want).max())


def test_adapter_loads_on_a_quantized_base(checkpoint, tiny_model_dir, tiny_model_dir_factory, tmp_path):
    """Made for the f32 conversion, run on the q8_0 one: the same tower, another quant."""
    q8 = tiny_model_dir_factory("q8_0")
    ft = convert_adapter(checkpoint, tmp_path / "ft", base=tiny_model_dir, outtype="f16")
    ids = _prompt(32)
    got = _hidden(q8 / "tower-q8_0.gguf", ids, ft / "adapter-f16.gguf")
    base = _hidden(q8 / "tower-q8_0.gguf", ids)
    assert np.isfinite(got).all() and float(np.abs(got - base).max()) > 0.1
    # Converted against the quantized base itself: the same file (shapes come from ne, not bytes).
    again = convert_adapter(checkpoint, tmp_path / "ft-q8", base=q8, outtype="f16")
    assert (again / "adapter-f16.gguf").read_bytes() == (ft / "adapter-f16.gguf").read_bytes()
    assert read_adapter_manifest(again)["base"]["tower"] == "tower-q8_0.gguf"


# --------------------------------------------------------------------------- refusals

def _visual(t):
    t[PREFIX.replace("language_model.", "") + "visual.blocks.0.attn.qkv.lora_A.weight"] = torch.zeros(8, 32)
    t[PREFIX.replace("language_model.", "") + "visual.blocks.0.attn.qkv.lora_B.weight"] = torch.zeros(96, 8)


def _pair(module: str, n_in: int, n_out: int):
    def add(t):
        t[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(8, n_in)
        t[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(n_out, 8)
    return add


def _drop_b(t):
    del t[PREFIX + "layers.0.mlp.up_proj.lora_B.weight"]


def _nan(t):
    t[PREFIX + "layers.1.mlp.up_proj.lora_B.weight"][0, 0] = float("nan")


def _modules_to_save(t):
    t["base_model.model.lm_head.modules_to_save.weight"] = torch.zeros(640, 64)


REFUSALS = [
    ("dora", lambda c: _edit_config(c, use_dora=True), ConversionError, "DoRA"),
    ("bias", lambda c: _edit_config(c, bias="all"), ConversionError, "trained biases"),
    ("not-lora", lambda c: _edit_config(c, peft_type="IA3"), ConversionError, "not LORA"),
    ("modules-to-save", lambda c: _edit_tensors(c, _modules_to_save), AdapterMismatch, "modules_to_save"),
    ("visual", lambda c: _edit_tensors(c, _visual), AdapterMismatch, "visual.blocks.0.attn.qkv"),
    ("lm-head", lambda c: _edit_tensors(c, _pair("lm_head", 64, 640)), AdapterMismatch, "'lm_head'"),
    ("embed", lambda c: _edit_tensors(c, _pair("model.language_model.embed_tokens", 640, 64)),
     AdapterMismatch, "embed_tokens"),
    ("fused-qkv", lambda c: _edit_tensors(c, _pair("model.language_model.layers.3.self_attn.qkv_proj", 64, 512)),
     AdapterMismatch, "qkv_proj.*no Qwen3.5 decoder layer"),
    ("gdn-on-attention-layer",
     lambda c: _edit_tensors(c, _pair("model.language_model.layers.3.linear_attn.in_proj_z", 64, 64)),
     AdapterMismatch, "has no blk.3.attn_gate.weight"),
    ("conv1d", lambda c: _edit_tensors(c, _pair("model.language_model.layers.0.linear_attn.conv1d", 4, 128)),
     AdapterMismatch, "not a linear projection"),
    ("unpaired", lambda c: _edit_tensors(c, _drop_b), CorruptModel, "has no lora_B"),
    ("nan", lambda c: _edit_tensors(c, _nan), CorruptModel, "NaN"),
    ("rank", lambda c: _edit_config(c, r=4), CorruptModel, "rank 8, adapter_config says 4"),
    ("no-config", lambda c: (c / "adapter" / "adapter_config.json").unlink(), ModelNotFound, "adapter_config"),
    ("no-weights", lambda c: (c / "adapter" / "adapter_model.safetensors").unlink(), ModelNotFound,
     "adapter_model.safetensors"),
    ("no-head", lambda c: (c / "joint_head.safetensors").unlink(), ModelNotFound, "--head"),
    ("corrupt-weights", lambda c: (c / "adapter" / "adapter_model.safetensors").write_bytes(b"\x10garbage"),
     CorruptModel, "adapter_model.safetensors is not a readable safetensors file"),
    ("truncated-weights", lambda c: (c / "adapter" / "adapter_model.safetensors").write_bytes(
        (c / "adapter" / "adapter_model.safetensors").read_bytes()[:5000]),
     CorruptModel, "adapter_model.safetensors is not a readable"),
    ("bad-config-json", lambda c: (c / "adapter" / "adapter_config.json").write_text("{"), CorruptModel,
     "not valid JSON"),
    ("head-shape", lambda c: save_file({"x": torch.zeros(3)}, str(c / "joint_head.safetensors")),
     HeadMismatch, "does not fit the head config"),
]


@pytest.mark.parametrize("case, damage, error, match", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_write_nothing(checkpoint, tiny_model_dir, tmp_path, case, damage, error, match):
    ckpt = _copy_ckpt(checkpoint, tmp_path)
    damage(ckpt)
    with pytest.raises(error, match=match):
        convert_adapter(ckpt, tmp_path / "out", base=tiny_model_dir)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging directory either


def test_another_model_size_is_refused_naming_both_shapes(checkpoint, tmp_path):
    other = convert_release(build_release(tmp_path / "rel256", preset="tiny256", seed=0), tmp_path / "m256")
    with pytest.raises(AdapterMismatch, match=r"layers.0.linear_attn.in_proj_qkv.*\[128, 64\].*"
                                              r"blk.0.attn_qkv.weight is \[512, 256\]"):
        convert_adapter(checkpoint, tmp_path / "out", base=other)
    assert not (tmp_path / "out").exists()


def test_bad_bases_are_refused(checkpoint, tiny_model_dir, tmp_path):
    with pytest.raises(ModelNotFound):
        convert_adapter(checkpoint, tmp_path / "out", base=tmp_path / "nowhere")
    with pytest.raises(ConversionError, match="model directory"):  # OUT would replace the base's manifest
        convert_adapter(checkpoint, tiny_model_dir, base=tiny_model_dir)
    with pytest.raises(ConversionError, match="unknown adapter outtype"):
        convert_adapter(checkpoint, tmp_path / "out", base=tiny_model_dir, outtype="q4_k_m")
    assert not (tmp_path / "out").exists()


def test_bare_peft_directory_with_head_option(checkpoint, tiny_model_dir, tmp_path):
    bare = Path(shutil.copytree(checkpoint / "adapter", tmp_path / "peft"))
    with pytest.raises(ModelNotFound, match="--head"):
        convert_adapter(bare, tmp_path / "out", base=tiny_model_dir)
    out = convert_adapter(bare, tmp_path / "out", base=tiny_model_dir,
                          head=checkpoint / "joint_head.safetensors")
    source = read_adapter_manifest(out)["source"]
    assert source["tool"] == "peft" and source["train_config"] is None
    assert read_adapter_manifest(out)["name"] == "peft"


def test_cli_convert_adapter(checkpoint, tiny_model_dir, tmp_path, capsys):
    from clef_gguf.cli import main

    assert main(["convert", "adapter", str(checkpoint), str(tmp_path / "ft"), "--base", str(tiny_model_dir),
                 "--outtype", "bf16", "--name", "n"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["adapter"] == str(tmp_path / "ft" / "adapter-bf16.gguf") and summary["targets"] == 31
    assert read_adapter_manifest(tmp_path / "ft")["name"] == "n"
    assert main(["convert-adapter", str(tmp_path / "nowhere"), str(tmp_path / "x"),
                 "--base", str(tiny_model_dir)]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "model_not_found"


# --------------------------------------------------------------------------- merged releases

def test_merged_release_carries_its_finetune_provenance(tiny_release, tmp_path):
    src = Path(shutil.copytree(tiny_release, tmp_path / "merged"))
    info = {"tool": "clef-finetune", "base_model": "Cloudflare/clef-flash", "checkpoint": "ckpt/checkpoint-10",
            "dtype": "bfloat16", "head_dtype": "bfloat16", "joint_schema_model_sha256": "0" * 64,
            "train_config": {"lora": {"r": 64}}}
    (src / "CLEF_FINETUNE.json").write_text(json.dumps(info))
    out = convert_release(src, tmp_path / "model")
    assert files.read_manifest(out)["finetune"] == info
    plain = convert_release(tiny_release, tmp_path / "plain")
    assert "finetune" not in files.read_manifest(plain)
    (src / "CLEF_FINETUNE.json").write_text("{")
    with pytest.raises(ConversionError, match="CLEF_FINETUNE.json"):
        convert_release(src, tmp_path / "broken")
    assert not (tmp_path / "broken").exists()
