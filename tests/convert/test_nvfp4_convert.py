"""convert.nvfp4 on the tiny release: which tensors become NVFP4 and how, what stays byte for byte,
the config compressed-tensors and transformers read back, W4A4 calibration, sharding, and failures
that leave nothing behind.

Measured on the tiny release (seed 0): relative Frobenius error of the dequantized weights 0.092 to
0.098 per module (0.095 over all 25); W4A4 input global scales 196 to 1654, i.e. calibrated input
amax 13.7 to 1.6 (layer 0's GDN projections read the normalised embeddings: amax 4.19, scale 641).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers  # a test dependency: missing, the run fails rather than skips
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_named_modules
from safetensors import safe_open

from clef_gguf.formats import files
from clef_gguf.convert.nvfp4 import SCHEMES, quantize_release
from clef_gguf.core.errors import ClefError, ConversionError, ModelNotFound
from clef_gguf.tower.nvfp4 import format as fmt
from clef_gguf.convert.samples import SAMPLE_REQUESTS

# The Linear layers the 27B recipe quantizes, by suffix; fused groups share their global scales.
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj")
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
         ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"))
TEXT_LAYERS = "model.language_model.layers."
MAX_REL_ERROR = 0.12


def read_all(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("model*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                assert name not in tensors, name
                tensors[name] = fh.get_tensor(name)
    return tensors


def target_modules(source: dict) -> list[str]:
    return [name[:-len(".weight")] for name in source
            if name.startswith(TEXT_LAYERS) and name.endswith(".weight")
            and name[:-len(".weight")].split(".", 4)[-1] in TARGETS]


@pytest.fixture(scope="module")
def source(tiny_release) -> dict[str, torch.Tensor]:
    return read_all(tiny_release)


@pytest.fixture(scope="module")
def converted(tiny_release, tmp_path_factory):
    """scheme -> output directory; W4A4 written in several shards to exercise the index."""
    made = {}

    def make(scheme: str):
        if scheme not in made:
            out = tmp_path_factory.mktemp(f"nvfp4-{scheme}") / "model"
            shard = 150_000 if scheme == "nvfp4" else None
            made[scheme] = quantize_release(tiny_release, out, scheme=scheme, name=f"tiny-{scheme}",
                                            **({"max_shard_bytes": shard} if shard else {}))
        return made[scheme]

    return make


@pytest.fixture(scope="module", params=SCHEMES)
def scheme(request) -> str:
    return request.param


def test_every_target_module_is_quantized(scheme, converted, source):
    out = read_all(converted(scheme))
    modules = target_modules(source)
    assert len(modules) == 3 * 6 + 7  # tiny: 3 GDN layers, 1 attention layer
    w4a4 = scheme == "nvfp4"
    for m in modules:
        n, k = source[f"{m}.weight"].shape
        assert f"{m}.weight" not in out
        assert out[f"{m}.weight_packed"].dtype == torch.uint8 and out[f"{m}.weight_packed"].shape == (n, k // 2)
        assert out[f"{m}.weight_scale"].dtype == torch.float8_e4m3fn and out[f"{m}.weight_scale"].shape == (n, k // 16)
        assert out[f"{m}.weight_global_scale"].dtype == torch.float32 and out[f"{m}.weight_global_scale"].shape == (1,)
        assert (f"{m}.input_global_scale" in out) is w4a4
        if w4a4:
            gi = out[f"{m}.input_global_scale"]
            assert gi.dtype == torch.float32 and gi.shape == (1,) and torch.isfinite(gi).all() and gi > 0
    assert len(out) == len(source) + len(modules) * (3 if w4a4 else 2)


def test_kept_tensors_are_bit_identical(scheme, converted, source):
    out = read_all(converted(scheme))
    kept = set(source) - {f"{m}.weight" for m in target_modules(source)}
    for must_keep in ("lm_head.weight", "model.language_model.embed_tokens.weight",
                      "model.language_model.layers.0.linear_attn.in_proj_a.weight",
                      "model.language_model.layers.0.linear_attn.in_proj_b.weight",
                      "model.language_model.layers.0.linear_attn.conv1d.weight",
                      "mtp.layers.0.self_attn.q_proj.weight", "model.visual.blocks.0.attn.qkv.weight"):
        assert must_keep in kept
    for name in kept:
        assert out[name].dtype == source[name].dtype, name
        assert torch.equal(out[name].view(torch.uint8), source[name].view(torch.uint8)), name


def test_dequantized_weights_are_close_and_fused_scales_shared(scheme, converted, source):
    out = read_all(converted(scheme))
    errors = {}
    for m in target_modules(source):
        w = source[f"{m}.weight"].float()
        g = out[f"{m}.weight_global_scale"]
        d = fmt.dequantize_weight(out[f"{m}.weight_packed"], out[f"{m}.weight_scale"], g)
        errors[m] = float((d - w).norm() / w.norm())
        again = fmt.quantize_weight(w, global_scale=g)  # the codes are exactly the format's for that scale
        assert torch.equal(again.packed, out[f"{m}.weight_packed"])
    assert max(errors.values()) < MAX_REL_ERROR, max(errors.items(), key=lambda kv: kv[1])
    assert min(errors.values()) > 0.01  # really 4-bit
    layers = {m.rsplit(".", 2)[0] for m in target_modules(source)}
    for layer in layers:
        for group in FUSED:
            members = [f"{layer}.{part}" for part in group if f"{layer}.{part}.weight" in source]
            if not members:
                continue
            own = [fmt.global_scale(source[f"{m}.weight"].float().abs().amax()) for m in members]
            for m in members:
                assert torch.equal(out[f"{m}.weight_global_scale"], torch.stack(own).min(dim=0).values), m
                if scheme == "nvfp4":
                    assert torch.equal(out[f"{m}.input_global_scale"], out[f"{members[0]}.input_global_scale"])


def test_config_parses_with_compressed_tensors(scheme, converted, tiny_release):
    out = converted(scheme)
    config = json.loads((out / "config.json").read_text())
    original = json.loads((tiny_release / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == original
    raw = config["quantization_config"]
    assert raw["quant_method"] == "compressed-tensors" and raw["format"] == "nvfp4-pack-quantized"
    parsed = QuantizationConfig.model_validate(raw)
    assert parsed.quantization_status == "compressed" and parsed.format == "nvfp4-pack-quantized"
    (group,) = parsed.config_groups.values()
    assert group.targets == ["Linear"]
    w = group.weights
    assert (w.num_bits, w.type, w.strategy, w.group_size, w.symmetric, w.dynamic) == \
        (4, "float", "tensor_group", 16, True, False)
    a = group.input_activations
    if scheme == "nvfp4a16":
        assert a is None
    else:
        assert (a.num_bits, a.type, a.strategy, a.group_size, a.dynamic) == (4, "float", "tensor_group", 16, "local")
    assert files.is_compressed_tensors(out)


def test_config_targets_exactly_the_quantized_tensors(scheme, converted, source):
    out = converted(scheme)
    config = transformers.AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    quant = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    (group,) = quant.config_groups.values()
    matched = {name for name, _ in match_named_modules(model, group.targets, quant.ignore)}
    assert matched == set(target_modules(source))


def test_transformers_loads_and_decompresses_it(scheme, converted, source):
    out = converted(scheme)
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.bfloat16)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)  # the decompression hook runs here
    stored = read_all(out)
    for m in target_modules(source):
        module = model.get_submodule(m)
        ours = fmt.dequantize_weight(stored[f"{m}.weight_packed"], stored[f"{m}.weight_scale"],
                                     stored[f"{m}.weight_global_scale"], torch.bfloat16)
        torch.testing.assert_close(module.weight, ours, rtol=2.0 ** -8, atol=0)  # their bf16 decode
        if scheme == "nvfp4":
            assert torch.equal(module.input_global_scale.data, stored[f"{m}.input_global_scale"])
        else:
            assert module.quantization_scheme.input_activations is None
    assert torch.equal(model.lm_head.weight, source["lm_head.weight"])
    assert not hasattr(model.get_submodule("model.language_model.layers.0.linear_attn.in_proj_a"),
                       "quantization_scheme")


def test_manifest_and_copied_files(scheme, converted, tiny_release):
    out = converted(scheme)
    manifest = files.read_manifest(out)
    assert manifest["outtype"] == scheme and manifest["name"] == f"tiny-{scheme}"
    assert manifest["tower"] == "config.json"
    for fname in (files.HEAD_WEIGHTS, files.HEAD_CONFIG, files.TOKENIZER, "tokenizer_config.json"):
        assert (out / fname).read_bytes() == (tiny_release / fname).read_bytes()
    found = files.from_directory(out)
    assert found.backend == "nvfp4" and found.name == f"tiny-{scheme}"
    src = manifest["source"]
    assert src["scheme"] == scheme and src["quantized_modules"] == 25 and src["random_weights"] is True
    assert (src["calibration"] is None) is (scheme == "nvfp4a16")
    assert not list(out.parent.glob(".*partial*"))


def test_sharded_output_has_an_index(converted):
    out = converted("nvfp4")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = read_all(out)
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, fname in index["weight_map"].items():
        with safe_open(str(out / fname), framework="pt") as fh:
            assert name in fh.keys()
    # the single-shard W4A16 output holds the very same weight tensors
    single = read_all(converted("nvfp4a16"))
    assert (converted("nvfp4a16") / "model.safetensors").is_file()
    assert all(torch.equal(single[n].view(torch.uint8), tensors[n].view(torch.uint8)) for n in single)


# --------------------------------------------------------------------------- W4A4 calibration

def test_input_global_scales_follow_the_calibration_prompts(converted, tiny_release, tmp_path):
    from clef_gguf.pipeline.encode import Encoder
    from clef_gguf.pipeline.request import parse_request

    stored = read_all(converted("nvfp4"))
    # Layer 0's GDN projections read input_layernorm(embed(ids)): their amax, computed directly.
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tiny_release, dtype=torch.float32)
    text = model.model.language_model
    encoder = Encoder.from_file(tiny_release / "tokenizer.json")

    def layer0_amax(requests):
        with torch.inference_mode():
            return max(float(text.layers[0].input_layernorm(text.embed_tokens(
                torch.as_tensor(encoder.encode(parse_request(r)).ids, dtype=torch.long)[None])).abs().amax())
                for r in requests)

    qkv = f"{TEXT_LAYERS}0.linear_attn.in_proj_qkv.input_global_scale"
    assert torch.equal(stored[qkv], fmt.global_scale(torch.tensor(layer0_amax(SAMPLE_REQUESTS))))
    one = quantize_release(tiny_release, tmp_path / "one", scheme="nvfp4", calibration=[SAMPLE_REQUESTS[2]])
    fewer = read_all(one)
    assert torch.equal(fewer[qkv], fmt.global_scale(torch.tensor(layer0_amax([SAMPLE_REQUESTS[2]]))))
    scales = [n for n in stored if n.endswith(".input_global_scale")]
    assert all(fewer[n] >= stored[n] for n in scales)  # fewer prompts, smaller amax, larger scale
    assert any(fewer[n] > stored[n] for n in scales)
    assert json.loads((one / files.MANIFEST).read_text())["source"]["calibration"]["requests"] == 1


# --------------------------------------------------------------------------- failures leave nothing

def _fails(exc_type, tmp_path, src, **kwargs):
    out = tmp_path / "out"
    with pytest.raises(exc_type) as info:
        quantize_release(src, out, **kwargs)
    assert isinstance(info.value, ClefError)
    assert not out.exists() and not list(tmp_path.glob(".out.partial*"))
    return info.value


def test_unknown_scheme(tiny_release, tmp_path):
    err = _fails(ConversionError, tmp_path, tiny_release, scheme="nvfp8")
    assert "nvfp4a16" in err.message and err.field == "scheme"


def test_source_without_head_files(tiny_release, tmp_path):
    src = shutil.copytree(tiny_release, tmp_path / "src")
    (src / files.HEAD_WEIGHTS).unlink()
    err = _fails(ModelNotFound, tmp_path, src, scheme="nvfp4a16")
    assert files.HEAD_WEIGHTS in err.message


def test_calibration_only_for_w4a4_and_must_be_valid(tiny_release, tmp_path):
    _fails(ConversionError, tmp_path, tiny_release, scheme="nvfp4a16", calibration=[SAMPLE_REQUESTS[0]])
    err = _fails(ConversionError, tmp_path, tiny_release, scheme="nvfp4", calibration=[{"state": "x"}])
    assert err.field == "calibration"
    _fails(ConversionError, tmp_path, tiny_release, scheme="nvfp4", calibration=[])


def test_already_quantized_source_is_refused(converted, tmp_path):
    _fails(ConversionError, tmp_path, converted("nvfp4a16"), scheme="nvfp4")


def test_a_failure_while_writing_leaves_nothing(tiny_release, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ConversionError("disk full")

    monkeypatch.setattr(files, "write_manifest", broken)
    _fails(ConversionError, tmp_path, tiny_release, scheme="nvfp4a16")


def test_bad_target_shape(tiny_release, tmp_path):
    from safetensors.torch import load_file, save_file

    src = shutil.copytree(tiny_release, tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    name = f"{TEXT_LAYERS}0.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :120].contiguous()  # K = 120: not a multiple of 16
    save_file(tensors, str(src / "model.safetensors"))
    err = _fails(ConversionError, tmp_path, src, scheme="nvfp4a16")
    assert "down_proj" in err.message and "multiple of 16" in err.message
