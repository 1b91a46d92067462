"""The random tiny release: deterministic, shaped like a real Clef release, loadable by transformers."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import unicodedata

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from clef_gguf.convert.synthetic.tiny import PLAIN_ADDED_TOKENS, PRESETS, SPECIAL_TOKENS, build_release

SAMPLES = [
    "Hello world",
    "<|im_start|>system\nYou are Clef.<|im_end|>\n<|im_start|>user\n{\"a\": 1}<|im_end|>",
    "<think>\nreasoning</think> answer <tool_call>x</tool_call>",
    "Résumé naïve café 中文 日本語 😀🚀 12345 3.14",
    unicodedata.normalize("NFD", "résumé déjà vu"),  # NFC normalizer must fold this
    "tabs\tand\n\nnewlines   and   spaces  ",
    "<|endoftext|><|vision_start|><|image_pad|><|vision_end|>",
]


def _digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_release_files(tiny_release):
    names = {p.name for p in tiny_release.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "joint_head.safetensors", "joint_head_config.json", "RANDOM_WEIGHTS.json"} <= names


def test_build_is_deterministic(tiny_release, tmp_path):
    again = build_release(tmp_path / "again", preset="tiny", seed=0)
    assert _digest(again) == _digest(tiny_release)
    other = build_release(tmp_path / "other", preset="tiny", seed=1)
    d0, d1 = _digest(tiny_release), _digest(other)
    assert d0["model.safetensors"] != d1["model.safetensors"]
    assert d0["joint_head.safetensors"] != d1["joint_head.safetensors"]
    assert d0["tokenizer.json"] == d1["tokenizer.json"]  # the tokenizer does not depend on the seed


def test_config_shape(tiny_release):
    cfg = json.loads((tiny_release / "config.json").read_text())
    text, p = cfg["text_config"], PRESETS["tiny"]
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert cfg["model_type"] == "qwen3_5" and text["model_type"] == "qwen3_5_text"
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["linear_num_value_heads"] != text["linear_num_key_heads"]
    assert text["tie_word_embeddings"] is False and cfg["tie_word_embeddings"] is False
    n_tok = Tokenizer.from_file(str(tiny_release / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert text["vocab_size"] > n_tok  # padding rows in the embedding
    rope = text["rope_parameters"]
    n_rot = int(text["head_dim"] * rope["partial_rotary_factor"])
    assert sum(rope["mrope_section"]) == n_rot // 2
    assert cfg["vision_config"]["out_hidden_size"] == text["hidden_size"] == p["hidden"]
    head = json.loads((tiny_release / "joint_head_config.json").read_text())
    assert head == p["head"]


def test_checkpoint_names_and_dtype(tiny_release):
    with safe_open(str(tiny_release / "model.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
        dtypes = {fh.get_slice(n).get_dtype() for n in names}
    assert dtypes == {"BF16"}
    assert any(n.startswith("model.visual.blocks.0.") for n in names)
    assert any(n.startswith("mtp.layers.0.") for n in names)
    assert "lm_head.weight" in names and "model.language_model.embed_tokens.weight" in names


def test_tokenizer_structure(tiny_release):
    spec = json.loads((tiny_release / "tokenizer.json").read_text())
    assert spec["model"]["type"] == "BPE" and len(spec["model"]["merges"]) > 100
    assert spec["normalizer"]["type"] == "NFC"
    pre = spec["pre_tokenizer"]["pretokenizers"]
    assert [x["type"] for x in pre] == ["Split", "ByteLevel"] and pre[1]["use_regex"] is False
    assert spec["decoder"]["type"] == "ByteLevel"
    added = {t["content"]: t["special"] for t in spec["added_tokens"]}
    assert all(added[t] for t in SPECIAL_TOKENS)
    assert not any(added[t] for t in PLAIN_ADDED_TOKENS)


def test_sharded_build(tmp_path):
    out = build_release(tmp_path / "sharded", preset="tiny", seed=0, shards=2, with_head=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (out / "model.safetensors").exists()
    total = 0
    for f in files:
        with safe_open(str(out / f), framework="pt") as fh:
            assert all(index["weight_map"][n] == f for n in fh.keys())
            total += len(list(fh.keys()))
    assert total == len(index["weight_map"])


def test_unknown_preset(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        build_release(tmp_path, preset="huge")


def test_builder_does_not_need_transformers(tmp_path):
    code = ("import sys\nsys.modules['transformers'] = None  # any import of it would now fail\n"
            "from clef_gguf.convert.synthetic.tiny import build_release\n"
            f"build_release({str(tmp_path / 'r')!r}, preset='tiny', seed=3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_transformers_loads_strictly(tiny_release):
    import transformers
    model, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        tiny_release, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    assert model.config.text_config.layer_types[-1] == "full_attention"


def test_autotokenizer_matches_tokenizers(tiny_release):
    import transformers
    auto = transformers.AutoTokenizer.from_pretrained(tiny_release)
    raw = Tokenizer.from_file(str(tiny_release / "tokenizer.json"))
    for text in SAMPLES:
        ids = raw.encode(text, add_special_tokens=False).ids
        assert auto(text, add_special_tokens=False)["input_ids"] == ids, text
        assert auto.decode(ids) == unicodedata.normalize("NFC", text)
    im_start = raw.token_to_id("<|im_start|>")
    assert raw.encode("<|im_start|>user").ids[0] == im_start
    assert auto.eos_token == "<|im_end|>" and auto.pad_token == "<|endoftext|>"
