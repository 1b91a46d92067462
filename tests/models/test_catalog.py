"""The packaged model catalog: facts are well-formed, names parse, unknown names say what exists."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from clef_gguf.core.errors import ModelNotFound
from clef_gguf.models import AUTO, CATALOG_ENV, Catalog, ModelRef, is_catalog_name, load_catalog, parse_name

# BF16 plus the 29 quants of the community GGUF card (shared seeds: clef-flash-gguf-card.md).
PUBLISHED_30 = ("BF16 Q8_0 Q6_K Q5_1 Q5_K_M Q5_K_S Q5_0 Q4_K_M Q4_1 IQ4_NL Q4_K_S Q4_0 IQ4_XS Q3_K_L Q3_K_M "
                "IQ3_M IQ3_S Q3_K_S IQ3_XS IQ3_XXS Q2_K Q2_K_S IQ2_M IQ2_S Q2_0 IQ2_XS IQ2_XXS IQ1_M IQ1_S "
                "Q1_0").split()


@pytest.fixture(scope="module")
def cat() -> Catalog:
    return Catalog.load()


def test_catalog_ships_as_package_data():
    text = resources.files("clef_gguf.models").joinpath("catalog.json").read_text()
    assert json.loads(text)["format"] == "clef-gguf-catalog/1"


def test_pinned_sources_and_known_facts(cat):
    flash, big = cat.family("clef-flash"), cat.family("clef")
    assert (flash.head_source.repo, flash.head_source.revision) == (
        "Cloudflare/clef-flash", "17f0b0ad64efb65d273590632833508766b2aae6")
    assert (big.head_source.repo, big.head_source.revision) == (
        "Cloudflare/clef", "ed3eed331870db2eff4b0db01237128ede8a00ce")
    repos = {s.repo: s for s in cat.sources.values()}
    for repo in ("NANI-Nithin/clef-flash-GGUF", "bartowski/Cloudflare_clef-flash-GGUF", "ggml-org/Clef-Flash-GGUF",
                 "myroslavtryhubets/clef-flash-NVFP4A16", "myroslavtryhubets/clef-flash-NVFP4"):
        assert repo in repos
    assert repos["ggml-org/Clef-Flash-GGUF"].role == "native"
    assert repos["myroslavtryhubets/clef-flash-NVFP4"].role == "nvfp4"
    assert set(PUBLISHED_30) <= set(repos["NANI-Nithin/clef-flash-GGUF"].files)
    nani = repos["NANI-Nithin/clef-flash-GGUF"].files
    assert (nani["BF16"].size_gb, nani["Q1_0"].size_gb) == (16.69, 1.83)
    q4 = repos["bartowski/Cloudflare_clef-flash-GGUF"].files["Q4_K_M"]
    assert (q4.file, q4.size) == ("Cloudflare_clef-flash-Q4_K_M.gguf", 5_841_052_992)


def test_every_fact_is_well_formed(cat):
    for src in cat.sources.values():
        assert src.revision is None or re.fullmatch(r"[0-9a-f]{40}", src.revision), src.id
        for entry in src.files.values():
            assert entry.sha256 is None or re.fullmatch(r"[0-9a-f]{64}", entry.sha256), (src.id, entry.key)
            assert entry.size is None or entry.size > 0
            assert entry.size_gb is None or entry.size_gb > 0
            if entry.sha256:  # a hash only makes sense for a file at a pinned revision
                assert src.pinned and entry.file
            if entry.file is None and src.role == "tower":
                assert src.file_pattern, f"{src.id}/{entry.key}: no file name and no way to find it"
    for family in cat.families.values():
        assert all(q in cat.quality_order for q in family.quants())
        assert all(q in cat.bpw for q in family.quants())
        for q in family.quants():
            size, basis = family.tower_size(q)
            assert size > 0 and basis in ("exact", "card", "proxy", "estimate")


def test_memory_constants_match_the_design_notes(cat):
    flash = cat.family("clef-flash")
    a, m = flash.architecture, flash.memory
    assert (a.hidden_size, a.layers, a.recurrent_layers, a.attention_layers) == (4096, 32, 24, 8)
    # KV f16 = attention layers x KV heads x head dim x (K, V) x 2 bytes = 32 KiB per token
    assert m.kv_bytes_per_token == a.attention_layers * a.kv_heads * a.head_dim * 2 * 2 == 32 * 1024
    # ~50 MiB of recurrent state per sequence: 24 x (24,576 + 524,288) f32
    assert m.recurrent_bytes_per_sequence == 24 * (24_576 + 524_288) * 4
    assert abs(m.head_bytes - 2 * 0.2435e9) < 0.02e9  # the fp32 head: twice its 243.5 MB bf16 file
    assert cat.family("clef").architecture.hidden_size == 5120


def test_sizes_are_ordered_like_the_quality_ladder_roughly(cat):
    flash = cat.family("clef-flash")
    sizes = {q: flash.tower_size(q)[0] for q in flash.quants()}
    assert sizes["BF16"] > sizes["Q8_0"] > sizes["Q6_K"] > sizes["Q4_K_M"] > sizes["Q2_K"] > sizes["Q1_0"]
    assert max(sizes.values()) == sizes["BF16"] and min(sizes.values()) == sizes["Q1_0"]


@pytest.mark.parametrize("name, expected", [
    ("clef-flash", ModelRef("clef-flash", AUTO)),
    ("clef-flash:auto", ModelRef("clef-flash", AUTO)),
    ("Clef-Flash:q4_k_m", ModelRef("clef-flash", "Q4_K_M")),
    ("clef:Q4_K_M", ModelRef("clef", "Q4_K_M")),
    ("clef-flash:IQ1_S", ModelRef("clef-flash", "IQ1_S")),
    ("clef-flash:Q4_K_M@bartowski", ModelRef("clef-flash", "Q4_K_M", "bartowski")),
    ("clef-flash:auto@nani-nithin", ModelRef("clef-flash", AUTO, "nani-nithin")),
])
def test_names_parse(cat, name, expected):
    assert cat.parse(name) == expected


def test_quant_option_overrides_and_str_round_trips(cat):
    ref = cat.parse("clef-flash:Q8_0", quant="q2_k")
    assert ref == ModelRef("clef-flash", "Q2_K") and cat.parse(str(ref)) == ref
    assert str(ModelRef("clef-flash", "Q4_K_M", "bartowski")) == "clef-flash:Q4_K_M@bartowski"


def test_default_source_prefers_pinned_repos(cat):
    flash = cat.family("clef-flash")
    assert flash.tower_source("Q4_K_M").alias == "bartowski"  # pinned, hashed
    assert flash.tower_source("IQ1_S").alias == "nani-nithin"  # only there


@pytest.mark.parametrize("name, message", [
    ("clef-mega", r"unknown model family 'clef-mega'; known: clef-flash, clef"),
    ("clef-flash:Q9_K", r"unknown quant 'Q9_K' for clef-flash; available: BF16, Q8_0"),
    ("clef:IQ1_S", r"unknown quant 'IQ1_S' for clef; available: Q4_K_M"),
    ("clef-flash:Q4_K_M@someone", r"unknown source 'someone'"),
    ("clef-flash:IQ1_S@bartowski", r"has no IQ1_S in the catalog; it offers: Q8_0"),
    ("", r"empty model name"),
])
def test_unknown_names_raise_model_not_found_listing_what_exists(cat, name, message):
    with pytest.raises(ModelNotFound, match=message) as err:
        cat.parse(name)
    assert err.value.code == "model_not_found" and err.value.field == "model"


def test_catalog_env_override_and_helpers(tmp_path, monkeypatch):
    data = json.loads(resources.files("clef_gguf.models").joinpath("catalog.json").read_text())
    del data["families"]["clef"]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv(CATALOG_ENV, str(path))
    assert list(load_catalog().families) == ["clef-flash"]
    assert is_catalog_name("clef-flash:Q4_K_M") and not is_catalog_name("./models/my-dir")
    assert parse_name("clef-flash:q8_0").quant == "Q8_0"
    path.write_text("{not json")
    with pytest.raises(ModelNotFound, match="cannot read model catalog"):
        Catalog.load(path)


# The seed card (community GGUF set, language tower only): file name -> size in GB as printed.
SEED_REPO = "NANI-Nithin/clef-flash-GGUF"
SEED_CARD = {
    "clef-flash-BF16.gguf": 16.69, "clef-flash-Q8_0.gguf": 8.87, "clef-flash-Q6_K.gguf": 6.85,
    "clef-flash-Q5_1.gguf": 6.33, "clef-flash-Q5_K_M.gguf": 6.02, "clef-flash-Q5_K_S.gguf": 5.87,
    "clef-flash-Q5_0.gguf": 5.87, "clef-flash-Q4_K_M.gguf": 5.24, "clef-flash-Q4_1.gguf": 5.41,
    "clef-flash-IQ4_NL.gguf": 5.05, "clef-flash-Q4_K_S.gguf": 4.98, "clef-flash-Q4_0.gguf": 4.95,
    "clef-flash-IQ4_XS.gguf": 4.84, "clef-flash-Q3_K_L.gguf": 4.59, "clef-flash-Q3_K_M.gguf": 4.31,
    "clef-flash-IQ3_M.gguf": 4.11, "clef-flash-IQ3_S.gguf": 4.07, "clef-flash-Q3_K_S.gguf": 3.97,
    "clef-flash-IQ3_XS.gguf": 3.95, "clef-flash-IQ3_XXS.gguf": 3.67, "clef-flash-Q2_K.gguf": 3.56,
    "clef-flash-Q2_K_S.gguf": 3.44, "clef-flash-IQ2_M.gguf": 3.36, "clef-flash-IQ2_S.gguf": 3.19,
    "clef-flash-Q2_0.gguf": 3.14, "clef-flash-IQ2_XS.gguf": 3.06, "clef-flash-IQ2_XXS.gguf": 2.89,
    "clef-flash-IQ1_M.gguf": 2.68, "clef-flash-IQ1_S.gguf": 2.55, "clef-flash-Q1_0.gguf": 1.83,
}


def test_every_seed_file_is_in_the_catalog_and_resolvable_by_name(cat):
    flash = cat.family("clef-flash")
    src = flash.source("nani-nithin")
    assert (src.repo, src.role, src.revision) == (SEED_REPO, "tower", None)  # pinned at first pull
    assert {e.file: e.size_gb for e in src.files.values()} == SEED_CARD
    assert sorted(src.quants) == sorted(PUBLISHED_30)
    for quant in PUBLISHED_30:
        ref = cat.parse(f"clef-flash:{quant.lower()}@NANI-Nithin")
        assert ref == ModelRef("clef-flash", quant, "nani-nithin")
        picked = flash.tower_source(ref.quant, ref.source)
        assert picked is src and picked.entry(quant).file == f"clef-flash-{quant}.gguf"
        assert picked.entry(quant).sha256 is None  # the card publishes none: the first pull pins it
        size, basis = flash.tower_size(quant, "nani-nithin")
        assert basis == "card" and size == round(SEED_CARD[f"clef-flash-{quant}.gguf"] * 1e9)


def test_list_available_shows_every_seed_file(monkeypatch, tmp_path, capsys):
    import argparse

    from clef_gguf.pick import catalog_commands as commands

    monkeypatch.delenv(CATALOG_ENV, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no pins yet
    parser = argparse.ArgumentParser()
    commands.add_list_arguments(parser)
    assert commands.run_list(parser.parse_args(["--available", "--json"])) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for quant in PUBLISHED_30:
        row = rows[f"clef-flash:{quant}@nani-nithin"]
        assert (row["repo"], row["role"], row["size_basis"]) == (SEED_REPO, "tower", "card")
        assert (row["revision"], row["pinned_by"]) == (None, None)
    # the plain name keeps preferring the pinned, hashed repo where both have the quant
    assert rows["clef-flash:Q4_K_M@bartowski"]["default"]
    assert not rows["clef-flash:Q4_K_M@nani-nithin"]["default"]
    assert rows["clef-flash:IQ1_S@nani-nithin"]["default"]
    assert rows["clef-flash:Q4_K_M@ggml-org"]["role"] == "native"
    assert commands.run_list(parser.parse_args(["--available"])) == 0
    text = capsys.readouterr().out
    assert sum(f"clef-flash:{q}@nani-nithin " in text for q in PUBLISHED_30) == 30
