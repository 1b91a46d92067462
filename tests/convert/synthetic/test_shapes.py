"""The shapes random models are made at: Clef-Flash's 9B read from the catalog, whole and cut to fewer
layers, and its tensor plan."""

from __future__ import annotations

import math

import pytest

from clef_gguf.convert.synthetic import big, shapes
from clef_gguf.convert.synthetic.tiny import build_tokenizer
from clef_gguf.core.errors import ConversionError


def test_flash9b_plan_has_the_9b_shape():
    p = shapes.preset_config("flash9b")
    text, d, items = shapes.plan(p, "bf16", build_tokenizer(p["bpe_vocab"]))
    assert (d.hidden, d.ffn, d.vocab, d.heads, d.kv_heads, d.head_dim) == (4096, 12288, 248320, 16, 4, 256)
    assert (d.lin_k_heads, d.lin_v_heads, d.lin_k_dim) == (16, 32, 128)
    assert d.layer_types.count("linear_attention") == 24 and d.layer_types.count("full_attention") == 8
    tower = [i for i in items if i.gguf_name is not None]
    values = sum(math.prod(i.shape) for i in tower)
    assert 8.9e9 < values < 9.1e9
    # Only the two vocab matrices are drawn in row blocks, and they need no edit.
    blocks = sorted(i.gguf_name for i in tower if math.prod(i.shape) > big.CHUNK_ELEMENTS)
    assert blocks == ["output.weight", "token_embd.weight"]
    assert all(not i.edits for i in tower if i.gguf_name in blocks)
    assert p["head"] == dict(hidden_size=4096, width=1024, routing_layers=2, layers=4, heads=16,
                             feedforward=4096)
    assert values < big.needed_bytes(p, "bf16") / 2 + 1 and big.needed_bytes(p, "Q4_K_M") < values * 1.1


def test_flash9b_is_the_catalogs_clef_flash_shape():
    """One home for the shape: the preset is read from the catalog's clef-flash architecture."""
    from clef_gguf.models.catalog import load_catalog

    a = load_catalog().families["clef-flash"].architecture
    p = shapes.preset_config("flash9b")
    assert (p["hidden"], p["layers"], p["ffn"], p["heads"], p["kv_heads"], p["head_dim"], p["vocab_size"]) == (
        a.hidden_size, a.layers, a.feed_forward, a.attention_heads, a.kv_heads, a.head_dim, a.vocab_size)
    assert p["layers"] // p["interval"] == a.attention_layers and p["mrope"] == list(a.mrope_sections)


def test_layers_keeps_the_shapes():
    p = shapes.preset_config("flash9b", layers=4)
    assert p["layers"] == 4 and p["hidden"] == 4096
    assert shapes.preset_config("flash9b")["layers"] == 32  # the preset itself is not changed
    with pytest.raises(ConversionError, match="multiple of 4"):
        shapes.preset_config("flash9b", layers=6)
    with pytest.raises(ConversionError, match="unknown preset"):
        shapes.preset_config("huge")


def test_the_catalog_is_the_one_clef_gguf_catalog_names(tmp_path, monkeypatch):
    """$CLEF_GGUF_CATALOG swaps the catalog for the shapes as it does for the models (one variable)."""
    import json

    from clef_gguf.models import catalog

    assert shapes.CATALOG_ENV == catalog.CATALOG_ENV
    data = json.loads(shapes.CATALOG_JSON.read_text(encoding="utf-8"))
    data["families"]["clef-flash"]["architecture"]["hidden_size"] = 2048
    mirror = tmp_path / "catalog.json"
    mirror.write_text(json.dumps(data), encoding="utf-8")
    monkeypatch.setenv(catalog.CATALOG_ENV, str(mirror))
    assert shapes.preset_config("flash9b")["hidden"] == 2048
    mirror.write_text("{}", encoding="utf-8")
    with pytest.raises(ConversionError, match="no architecture for family 'clef-flash'"):
        shapes.preset_config("flash9b")


def test_preset_for_maps_a_family_to_its_confirmed_shape():
    assert shapes.preset_for("clef-flash") == "flash9b"
    assert shapes.preset_for("clef-27b") is None
