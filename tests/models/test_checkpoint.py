"""NVFP4 checkpoints (the nvfp4 backend) through pull / resolve / list, against a fake Hub on loopback.

A checkpoint is a whole repository directory: pull takes its checkpoint files (config, safetensors
weights, index, tokenizer, head) at one commit, each verified and pinned like a GGUF, into the HF
cache's snapshot directory, and hands out ``files.from_directory`` of it (backend "nvfp4").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from importlib import resources

import pytest

from _fakehub import FakeHub, cli_parsers, head_source, nvfp4_checkpoint, point_at, sha256
from clef_gguf.core.errors import CorruptModel, ModelNotFound, PinMismatch
from clef_gguf.formats.files import from_directory
from clef_gguf.models import hub, listing, pins, placement
from clef_gguf.pick import catalog_commands as commands
from clef_gguf.models.catalog import CATALOG_ENV, Catalog
from clef_gguf.core.limits import GiB
from clef_gguf.models.machine import DeviceProfile

HEAD_REPO, TOWER_REPO = "test-org/clef-flash", "test-org/clef-flash-GGUF"
W4A4_REPO, W4A16_REPO, BROKEN_REPO = "test-org/clef-flash-NVFP4", "test-org/clef-flash-NVFP4A16", "test-org/broken"
HEAD_REV, TOWER_REV, W4A4_REV, C1, C2 = "b" * 40, "a" * 40, "4" * 40, "1" * 40, "2" * 40
HEAD = {"joint_head.safetensors": os.urandom(4_000), "joint_head_config.json": b'{"hidden_size": 64}',
        "tokenizer.json": b'{"model": {"vocab": {}}}'}
Q4 = b"GGUF" + os.urandom(20_000)
# What a pull takes of a repository: the packaged catalog's checkpoint layout.
TAKEN = {"config.json", "tokenizer.json", "tokenizer_config.json", "joint_head.safetensors",
         "joint_head_config.json", "model.safetensors.index.json"}
BIG = DeviceProfile(total_ram=64 * GiB, available_ram=60 * GiB, arch="x86_64")


def packaged() -> dict:
    return json.loads(resources.files("clef_gguf.models").joinpath("catalog.json").read_text())


def checkpoint_source(alias: str, repo: str, quant: str, scheme: str, revision: str | None) -> dict:
    facts = packaged()["sources"]["nvfp4a16-clef-flash"]["checkpoint"]
    return {"family": "clef-flash", "alias": alias, "role": "nvfp4", "repo": repo, "revision": revision,
            "files": {}, "checkpoint": {**facts, "quant": quant, "scheme": scheme}}


def catalog_dict() -> dict:
    """The packaged layout and memory figures, pointed at fake repos: the W4A4 source pinned by the
    catalog (a sharded repo with its own head), the W4A16 one at its first pull (no head files)."""
    data = packaged()
    family = data["families"]["clef-flash"]
    family.update(head_source="head", tower_sources=["tower"], other_sources=["w4a4", "w4a16", "broken"])
    return {
        "format": "clef-gguf-catalog/1", "quant_types": {"order": ["Q4_K_M"], "bpw": {"Q4_K_M": 4.85}},
        "checkpoint_files": data["checkpoint_files"], "families": {"clef-flash": family},
        "sources": {
            "head": head_source(HEAD_REPO, HEAD_REV, HEAD),
            "tower": {"family": "clef-flash", "alias": "testsrc", "role": "tower", "repo": TOWER_REPO,
                      "revision": TOWER_REV, "files": {"Q4_K_M": {"file": "Clef-Q4_K_M.gguf", "size": len(Q4),
                                                                  "sha256": sha256(Q4)}}},
            "w4a4": checkpoint_source("nvfp4", W4A4_REPO, "NVFP4", "W4A4", W4A4_REV),
            "w4a16": checkpoint_source("nvfp4a16", W4A16_REPO, "NVFP4A16", "W4A16", None),
            "broken": checkpoint_source("broken", BROKEN_REPO, "NVFP4X", "W4A16", None),
        },
    }


@pytest.fixture
def cat():
    return Catalog.from_dict(catalog_dict())


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    server = FakeHub()
    server.add(HEAD_REPO, HEAD_REV, HEAD)
    server.add(TOWER_REPO, TOWER_REV, {"Clef-Q4_K_M.gguf": Q4})
    server.add(W4A4_REPO, W4A4_REV, nvfp4_checkpoint(shards=2, head=HEAD, scheme="W4A4"))
    server.add(W4A16_REPO, C1, nvfp4_checkpoint(seed=1))
    server.start()
    point_at(monkeypatch, server, tmp_path / "hf")
    yield server
    server.stop()


def snapshot(tmp_path, repo, commit):
    return tmp_path / "hf" / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / commit


def served(server, repo, commit):
    return server.repos[repo].commits[commit]


def transfers(server, commit=None):
    return [p for m, p in server.requests if m == "GET" and "/resolve/" in p and (commit is None or commit in p)]


def test_pull_downloads_the_checkpoint_at_the_pinned_revision(fake_hub, cat, tmp_path):
    files = hub.pull("clef-flash:nvfp4", catalog=cat, progress=False)
    snap = snapshot(tmp_path, W4A4_REPO, W4A4_REV)
    assert files.backend == "nvfp4" and files.tower == snap / "config.json"
    assert (files.head_weights, files.head_config, files.tokenizer) == (
        snap / "joint_head.safetensors", snap / "joint_head_config.json", snap / "tokenizer.json")
    files.check_exist()
    assert files.name == "clef-flash:NVFP4@nvfp4" and files.revision == f"{W4A4_REPO}@{W4A4_REV}"
    repo = served(fake_hub, W4A4_REPO, W4A4_REV)
    shards = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert {p.name for p in snap.iterdir()} == TAKEN | shards  # no README, code, nested folder
    for name in TAKEN | shards:
        assert (snap / name).read_bytes() == repo[name]
        assert files.sha256[name] == sha256(repo[name])
    # Every request named the catalog's commit (the listing included), never a branch.
    assert fake_hub.requests and all(W4A4_REV in p for _, p in fake_hub.requests)
    assert from_directory(snap).backend == "nvfp4"
    before = len(fake_hub.requests)  # pulled again: the complete cached snapshot, no request at all
    assert hub.pull("clef-flash:NVFP4", catalog=cat, progress=False).tower == files.tower
    assert len(fake_hub.requests) == before


def test_a_repo_without_head_files_takes_them_from_the_release_and_is_pinned_at_first_pull(
        fake_hub, cat, tmp_path):
    files = hub.pull("clef-flash:nvfp4a16", catalog=cat, progress=False)
    snap = snapshot(tmp_path, W4A16_REPO, C1)
    assert files.backend == "nvfp4" and files.tower == snap / "config.json"
    assert files.tower.read_bytes() == served(fake_hub, W4A16_REPO, C1)["config.json"]
    assert (snap / "model.safetensors").is_file() and not (snap / "README.md").exists()
    assert files.tokenizer == snap / "tokenizer.json"  # its own tokenizer
    assert files.head_weights.read_bytes() == HEAD["joint_head.safetensors"]
    assert files.head_weights.parent.name == HEAD_REV and files.head_config.parent.name == HEAD_REV
    assert files.revision == f"{W4A16_REPO}@{C1}; {HEAD_REPO}@{HEAD_REV}"
    files.check_exist()
    entry = pins.pin(W4A16_REPO)
    repo = served(fake_hub, W4A16_REPO, C1)
    assert entry["commit"] == C1
    assert entry["files"] == {n: {"sha256": sha256(repo[n]), "size": len(repo[n])}
                              for n in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")}


def test_a_moved_main_is_refused_until_update_and_resolve_keeps_the_pin(fake_hub, cat):
    first = hub.pull("clef-flash:nvfp4a16", catalog=cat, progress=False)
    fake_hub.add(W4A16_REPO, C2, nvfp4_checkpoint(seed=2))
    with pytest.raises(PinMismatch, match="clef-gguf pull clef-flash:NVFP4A16@nvfp4a16 --update") as err:
        hub.pull("clef-flash:nvfp4a16", catalog=cat, progress=False)
    assert C1 in str(err.value) and C2 in str(err.value) and not transfers(fake_hub, C2)
    before = len(fake_hub.requests)
    assert hub.resolve("clef-flash:nvfp4a16", allow_download=True, catalog=cat).tower == first.tower
    assert len(fake_hub.requests) == before  # the pinned, cached checkpoint: no request at all
    updated = hub.pull("clef-flash:nvfp4a16", catalog=cat, progress=False, update=True)
    assert updated.tower.parent.name == C2 and pins.pin(W4A16_REPO)["commit"] == C2
    assert updated.tower.parent.joinpath("model.safetensors").read_bytes() == \
        served(fake_hub, W4A16_REPO, C2)["model.safetensors"]


def test_offline_and_not_pulled_says_so(fake_hub, cat, monkeypatch):
    with pytest.raises(ModelNotFound, match="downloading was not allowed"):
        hub.resolve("clef-flash:nvfp4", catalog=cat)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("clef-flash:nvfp4", "clef-flash:nvfp4a16"):  # catalog-pinned, pinned at first pull
        with pytest.raises(ModelNotFound, match="not in the Hugging Face cache") as err:
            hub.pull(name, catalog=cat, progress=False)
        assert "HF_HUB_OFFLINE" in str(err.value) and "clef-gguf pull" in str(err.value)
    assert fake_hub.requests == []


def test_offline_after_a_pull_needs_no_network(fake_hub, cat, monkeypatch):
    pulled = [hub.pull(n, catalog=cat, progress=False) for n in ("clef-flash:nvfp4", "clef-flash:nvfp4a16")]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub.fail_all = True
    before = len(fake_hub.requests)
    again = [hub.resolve(n, allow_download=True, catalog=cat) for n in ("clef-flash:nvfp4", "clef-flash:nvfp4a16")]
    assert [f.paths() for f in again] == [f.paths() for f in pulled] and len(fake_hub.requests) == before
    assert all(f.backend == "nvfp4" for f in again)


def test_offline_with_a_shard_gone_says_it_is_not_cached(fake_hub, cat, monkeypatch):
    files = hub.pull("clef-flash:nvfp4", catalog=cat, progress=False)
    (files.tower.parent / "model-00002-of-00002.safetensors").unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="model-00002-of-00002.safetensors is not in the Hugging Face cache"):
        hub.resolve("clef-flash:nvfp4", allow_download=True, catalog=cat)


@pytest.mark.parametrize("drop, message", [
    ("config.json", r"lacks config.json: not a checkpoint clef-gguf can pull"),
    ("model.safetensors", r"lacks weight files \(\*.safetensors\)"),
])
def test_a_repo_missing_files_is_refused_before_any_download(fake_hub, cat, drop, message):
    files = nvfp4_checkpoint()
    del files[drop]
    fake_hub.add(BROKEN_REPO, C1, files)
    with pytest.raises(ModelNotFound, match=message) as err:
        hub.pull("clef-flash:nvfp4x", catalog=cat, progress=False)
    assert BROKEN_REPO in str(err.value) and err.value.code == "model_not_found"
    assert not transfers(fake_hub)


def test_an_index_naming_a_missing_shard_is_refused_before_the_weights(fake_hub, cat):
    files = nvfp4_checkpoint(shards=3)
    del files["model-00002-of-00003.safetensors"]
    fake_hub.add(BROKEN_REPO, C1, files)
    with pytest.raises(ModelNotFound, match="lacks model-00002-of-00003.safetensors, named by its "
                                            "model.safetensors.index.json"):
        hub.pull("clef-flash:nvfp4x", catalog=cat, progress=False)
    assert not [p for p in transfers(fake_hub) if p.endswith(".safetensors")]


def test_a_config_that_is_not_compressed_tensors_is_refused(fake_hub, cat):
    files = nvfp4_checkpoint()
    files["config.json"] = b'{"model_type": "qwen3_5"}'
    fake_hub.add(BROKEN_REPO, C1, files)
    with pytest.raises(CorruptModel, match="quant_method compressed-tensors: not an NVFP4 checkpoint"):
        hub.pull("clef-flash:nvfp4x", catalog=cat, progress=False)


def test_a_missing_repo_says_so(fake_hub, cat):
    with pytest.raises(ModelNotFound, match=f"repository {BROKEN_REPO} not found"):
        hub.pull("clef-flash:nvfp4x", catalog=cat, progress=False)


def test_a_corrupted_shard_is_caught_and_removed(fake_hub, cat, tmp_path):
    name = "model-00001-of-00002.safetensors"
    good = served(fake_hub, W4A4_REPO, W4A4_REV)[name]
    fake_hub.repos[W4A4_REPO].corrupt[name] = good[:-1] + bytes([good[-1] ^ 0xFF])
    with pytest.raises(CorruptModel, match=f"sha256 mismatch for {W4A4_REPO} / {name}"):
        hub.pull("clef-flash:nvfp4", catalog=cat, progress=False)
    assert not (snapshot(tmp_path, W4A4_REPO, W4A4_REV) / name).exists()
    del fake_hub.repos[W4A4_REPO].corrupt[name]
    assert (hub.pull("clef-flash:nvfp4", catalog=cat, progress=False).tower.parent / name).read_bytes() == good


def test_list_shows_pulled_checkpoints(fake_hub, cat):
    hub.pull("clef-flash:nvfp4", catalog=cat, progress=False)
    hub.pull("clef-flash:nvfp4a16", catalog=cat, progress=False)
    rows = {m.name: m for m in listing.list_local(catalog=cat)}
    w4a4, w4a16 = rows["clef-flash:NVFP4@nvfp4"], rows["clef-flash:NVFP4A16@nvfp4a16"]
    repo = served(fake_hub, W4A4_REPO, W4A4_REV)
    assert (w4a4.backend, w4a4.quant, w4a4.commit, w4a4.pinned, w4a4.pinned_by, w4a4.file) == (
        "nvfp4", "NVFP4", W4A4_REV, True, "catalog", "config.json")
    assert w4a4.head_ready and w4a4.verified and w4a4.path.name == W4A4_REV
    assert w4a4.size_bytes == sum(len(repo[n]) for n in repo if n in TAKEN or n.startswith("model-"))
    assert (w4a16.commit, w4a16.pinned_by, w4a16.head_ready, w4a16.verified) == (C1, "first pull", True, True)
    assert json.dumps([m.to_dict() for m in rows.values()])
    # resolve's auto never takes a checkpoint, cached or not
    assert hub.resolve("clef-flash", allow_download=True, catalog=cat, profile=BIG,
                       progress=False).name == "clef-flash:Q4_K_M@testsrc"
    (w4a4.path / "model-00002-of-00002.safetensors").unlink()  # a shard lost: incomplete
    assert not {m.name: m for m in listing.list_local(catalog=cat)}["clef-flash:NVFP4@nvfp4"].head_ready


def test_names_and_auto(cat, fake_hub):
    assert str(cat.parse("clef-flash:nvfp4a16")) == "clef-flash:NVFP4A16"
    assert str(cat.parse("clef-flash@nvfp4")) == "clef-flash:NVFP4@nvfp4"  # a checkpoint source has one quant
    assert cat.parse("clef-flash:auto").auto
    with pytest.raises(ModelNotFound, match=r"available: Q4_K_M, NVFP4, NVFP4A16, NVFP4X"):
        cat.parse("clef-flash:NVFP8")
    with pytest.raises(ModelNotFound, match="has no Q4_K_M"):
        cat.parse("clef-flash:Q4_K_M@nvfp4")
    with pytest.raises(ModelNotFound, match="checkpoint directory, not one file"):
        hub.pull_file("clef-flash:nvfp4", catalog=cat)
    assert hub.pull("clef-flash", catalog=cat, profile=BIG, progress=False).backend == "gguf"


def test_cli_pull_list_and_help(fake_hub, cat, tmp_path, monkeypatch, capsys):
    pull_parser, list_parser = cli_parsers(catalog_dict(), tmp_path, monkeypatch)
    assert "clef-flash:nvfp4a16" in pull_parser.format_help() and "NVFP4" in list_parser.format_help()

    assert commands.run_pull(pull_parser.parse_args(["clef-flash:nvfp4a16", "--no-progress", "--json"])) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["backend"] == "nvfp4" and out["tower"].endswith(f"{C1}/config.json")
    assert "compressed-tensors NVFP4 W4A16 checkpoint" in captured.err and "no pinned revision" in captured.err
    assert commands.run_list(list_parser.parse_args([])) == 0
    assert "clef-flash:NVFP4A16@nvfp4a16" in (text := capsys.readouterr().out)
    assert "ready, verified (nvfp4 checkpoint)" in text
    assert commands.run_list(list_parser.parse_args(["--available", "--json"])) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert (rows["clef-flash:NVFP4A16@nvfp4a16"]["revision"], rows["clef-flash:NVFP4@nvfp4"]["revision"]) == (
        C1, W4A4_REV)


def test_list_available_shows_the_packaged_nvfp4_sources(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(CATALOG_ENV, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    parser = argparse.ArgumentParser()
    commands.add_list_arguments(parser)
    assert commands.run_list(parser.parse_args(["--available", "--json"])) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    expected = {"clef-flash:NVFP4A16@nvfp4a16": ("myroslavtryhubets/clef-flash-NVFP4A16", 9.1e9, "proxy"),
                "clef-flash:NVFP4@nvfp4": ("myroslavtryhubets/clef-flash-NVFP4", 9.1e9, "card"),
                "clef:NVFP4@nvfp4": ("myroslavtryhubets/clef-NVFP4", None, "unknown")}
    for name, (repo, size, basis) in expected.items():
        row = rows[name]
        assert (row["backend"], row["role"], row["repo"], row["size_bytes"], row["size_basis"]) == (
            "nvfp4", "nvfp4", repo, size, basis)
        assert row["default"] and (row["revision"], row["pinned_by"]) == (None, None)
    assert {r["backend"] for n, r in rows.items() if n not in expected} == {"gguf"}
    # each checkpoint also by its re-encoding as an NVFP4 GGUF (models/nvfp4_materialize.py): the same bytes
    again = rows["clef-flash:NVFP4A16-GGUF@nvfp4a16"]
    assert (again["backend"], again["repo"], again["size_bytes"]) == (
        "gguf", "myroslavtryhubets/clef-flash-NVFP4A16", 9.1e9)
    assert commands.run_list(parser.parse_args(["--available"])) == 0
    text = capsys.readouterr().out
    assert "clef-flash:NVFP4A16@nvfp4a16" in text and "myroslavtryhubets/clef-NVFP4" in text
    assert "? GB (unknown" in text and "nvfp4 backend" in text


def test_the_packaged_checkpoints_parse_and_never_enter_auto():
    cat = Catalog.load()
    flash = cat.family("clef-flash")
    assert flash.checkpoint_quants() == ["NVFP4A16", "NVFP4"]
    assert cat.family("clef").checkpoint_quants() == ["NVFP4"]
    for name, repo in (("clef-flash:nvfp4a16", "myroslavtryhubets/clef-flash-NVFP4A16"),
                       ("clef-flash:NVFP4", "myroslavtryhubets/clef-flash-NVFP4"),
                       ("clef:nvfp4", "myroslavtryhubets/clef-NVFP4")):
        ref = cat.parse(name)
        src = cat.family(ref.family).tower_source(ref.quant, ref.source)
        assert src.repo == repo and src.backend == "nvfp4" and src.checkpoint.quant == ref.quant
        ck = src.checkpoint
        assert ck.quantized_weights_bytes > ck.bf16_weights_bytes > ck.dequant_scratch_bytes > 0
    assert not set(flash.checkpoint_quants()) & set(flash.quants())
    rec = placement.recommend(BIG, flash)
    assert rec.quant in flash.quants() and {c.quant for c in rec.candidates} == set(flash.quants())


def test_pull_from_a_copied_snapshot_directory(fake_hub, cat, tmp_path):
    """What pull returns is an ordinary checkpoint directory: a copy of it loads the same way."""
    files = hub.pull("clef-flash:nvfp4", catalog=cat, progress=False)
    copy = shutil.copytree(files.tower.parent, tmp_path / "copy")
    assert from_directory(copy).backend == "nvfp4" and from_directory(copy).tower == copy / "config.json"
