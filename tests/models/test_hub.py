"""pull / resolve / list against a fake Hub on loopback, through huggingface_hub's real download code."""

from __future__ import annotations

import json
import os

import pytest

from _fakehub import FakeHub, cli_parsers, head_source, point_at, sha256
from clef_gguf.models import hub, listing
from clef_gguf.pick import catalog_commands as commands
from clef_gguf.core.limits import GiB
from clef_gguf.models.machine import DeviceProfile
from clef_gguf.core.errors import ConversionError, CorruptModel, ModelNotFound, NoQuantFits
from clef_gguf.models.catalog import Catalog

TOWER_REPO, HEAD_REPO, LOOSE_REPO, NATIVE_REPO = (
    "test-org/clef-flash-GGUF", "test-org/clef-flash", "other/clef-flash-GGUF", "test-org/Native-GGUF")
TOWER_REV, HEAD_REV, LOOSE_REV, NATIVE_REV = ("a" * 40, "b" * 40, "c" * 40, "d" * 40)

# Any bytes work for pull; the GGUF magic keeps them honest-looking. 300 kB spans several chunks.
Q8 = b"GGUF" + os.urandom(300_000)
Q4 = b"GGUF" + os.urandom(200_000)
IQ2 = b"GGUF" + os.urandom(100_000)
NATIVE = b"GGUF" + os.urandom(50_000)
HEAD = {"joint_head.safetensors": os.urandom(40_000), "joint_head_config.json": b'{"hidden_size": 64}',
        "tokenizer.json": b'{"model": {}}'}
BIG = DeviceProfile(total_ram=64 * GiB, available_ram=60 * GiB, arch="x86_64")
SMALL = DeviceProfile(total_ram=9 * GiB, available_ram=8 * GiB, arch="x86_64")


def catalog_dict(**tower_files) -> dict:
    """A catalog shaped like the real one, pointing at the fake repos; sizes drive the policy."""
    files = {
        "Q8_0": {"file": "Clef-Test-Q8_0.gguf", "size": None, "size_gb": 9.55, "sha256": sha256(Q8)},
        "Q4_K_M": {"file": "Clef-Test-Q4_K_M.gguf", "size": len(Q4), "size_gb": 5.84, "sha256": sha256(Q4)},
    }
    files.update(tower_files)
    return {
        "format": "clef-gguf-catalog/1",
        "quant_types": {"order": ["Q8_0", "Q4_K_M", "IQ2_XS"], "bpw": {"Q8_0": 8.5, "Q4_K_M": 4.85, "IQ2_XS": 2.31}},
        "families": {"clef-flash": {
            "architecture": {"hidden_size": 4096, "layers": 32, "recurrent_layers": 24, "attention_layers": 8,
                             "attention_heads": 16, "kv_heads": 4, "head_dim": 256, "vocab_size": 248320,
                             "max_context": 262144},
            "memory": {"kv_bytes_per_token": 32768, "recurrent_bytes_per_sequence": 52690944,
                       "head_bytes": 243538016, "activation_bytes_per_token": 4096, "compute_bytes": 536870912,
                       "runtime_bytes": 671088640},
            "size_estimate": {"overhead_bytes": 429000000, "bytes_per_bpw": 1095500000},
            "head_source": "head", "tower_sources": ["tower", "loose"], "other_sources": ["native"]}},
        "sources": {
            "head": head_source(HEAD_REPO, HEAD_REV, HEAD),
            "tower": {"family": "clef-flash", "alias": "testsrc", "role": "tower", "repo": TOWER_REPO,
                      "revision": TOWER_REV, "files": files},
            "loose": {"family": "clef-flash", "alias": "loose", "role": "tower", "repo": LOOSE_REPO,
                      "revision": None, "file_pattern": "*-{quant}.gguf",
                      "files": {"IQ2_XS": {"file": None, "size_gb": 2.96}}},
            "native": {"family": "clef-flash", "alias": "native", "role": "native", "repo": NATIVE_REPO,
                       "revision": NATIVE_REV, "files": {"Q4_K_M": {"file": "Native-Q4_K_M.gguf"}}},
        },
    }


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    server = FakeHub()
    server.add(TOWER_REPO, TOWER_REV, {"Clef-Test-Q8_0.gguf": Q8, "Clef-Test-Q4_K_M.gguf": Q4, "README.md": b"x"})
    server.add(HEAD_REPO, HEAD_REV, HEAD)
    server.add(LOOSE_REPO, LOOSE_REV, {"clef-flash-IQ2_XS.gguf": IQ2, "mmproj-clef-flash-IQ2_XS.gguf": b"m"})
    server.add(NATIVE_REPO, NATIVE_REV, {"Native-Q4_K_M.gguf": NATIVE})
    server.start()
    point_at(monkeypatch, server, tmp_path / "hf")
    yield server
    server.stop()


@pytest.fixture
def cat():
    return Catalog.from_dict(catalog_dict())


def gets(server, name):
    return [p for m, p in server.requests if m == "GET" and p.endswith(name)]


def test_pull_lands_in_the_cache_at_the_pinned_revision(fake_hub, cat, tmp_path):
    files = hub.pull("clef-flash:Q4_K_M", catalog=cat, progress=False)
    snap = tmp_path / "hf" / "hub" / "models--test-org--clef-flash-GGUF" / "snapshots" / TOWER_REV
    assert files.tower == snap / "Clef-Test-Q4_K_M.gguf"
    assert files.tower.read_bytes() == Q4
    assert files.head_weights.read_bytes() == HEAD["joint_head.safetensors"]
    assert files.tokenizer.parent.name == HEAD_REV and files.head_config.read_bytes() == HEAD["joint_head_config.json"]
    assert files.name == "clef-flash:Q4_K_M@testsrc"
    assert files.revision == f"{TOWER_REPO}@{TOWER_REV}; {HEAD_REPO}@{HEAD_REV}"
    assert files.sha256["Clef-Test-Q4_K_M.gguf"] == sha256(Q4)
    assert files.sha256["joint_head_config.json"] == sha256(HEAD["joint_head_config.json"])
    files.check_exist()
    # every request asked for the pinned commit, never a branch
    assert all(f"/resolve/{TOWER_REV}/" in p or f"/resolve/{HEAD_REV}/" in p for _, p in fake_hub.requests)
    [local] = listing.list_local(catalog=cat)
    assert (local.name, local.quant, local.commit, local.pinned, local.verified, local.head_ready) == (
        "clef-flash:Q4_K_M@testsrc", "Q4_K_M", TOWER_REV, True, True, True)
    assert local.size_bytes == len(Q4)


def test_pull_of_cached_pinned_files_makes_no_request(fake_hub, cat):
    hub.pull("clef-flash:Q4_K_M", catalog=cat, progress=False)
    before = len(fake_hub.requests)
    again = hub.pull("clef-flash:q4_k_m", catalog=cat, progress=False)
    assert len(fake_hub.requests) == before and again.tower.read_bytes() == Q4


def test_interrupted_download_resumes_with_range(fake_hub, cat):
    fake_hub.repos[TOWER_REPO].drop_once.add("Clef-Test-Q8_0.gguf")
    files = hub.pull("clef-flash:Q8_0", catalog=cat, progress=False)
    assert files.tower.read_bytes() == Q8
    assert len(gets(fake_hub, "Clef-Test-Q8_0.gguf")) == 2  # the broken one, then the resumed one


def test_offline_resolves_from_cache_without_network(fake_hub, cat, monkeypatch):
    hub.pull("clef-flash:Q4_K_M", catalog=cat, progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub.fail_all = True
    before = len(fake_hub.requests)
    files = hub.resolve("clef-flash:Q4_K_M", allow_download=True, catalog=cat)
    assert files.tower.read_bytes() == Q4 and len(fake_hub.requests) == before


def test_offline_and_not_cached_fails_clearly(fake_hub, cat, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE") as err:
        hub.resolve("clef-flash:Q8_0", allow_download=True, catalog=cat)
    assert "clef-gguf pull" in str(err.value)
    with pytest.raises(ModelNotFound, match="not in the Hugging Face cache"):
        hub.pull("clef-flash:Q8_0", catalog=cat)
    assert fake_hub.requests == []


def test_resolve_does_not_download_unless_allowed(fake_hub, cat):
    with pytest.raises(ModelNotFound, match="not allowed"):
        hub.resolve("clef-flash:Q4_K_M", catalog=cat)
    assert fake_hub.requests == []
    assert hub.resolve("clef-flash:Q4_K_M", allow_download=True, catalog=cat, progress=False).tower.is_file()


@pytest.mark.parametrize("catalog_knows_sha", [True, False])
def test_corrupted_download_is_reported_and_not_used(fake_hub, catalog_knows_sha, tmp_path):
    # Without a catalog hash the Hub's LFS sha256 (X-Linked-Etag, the blob's name) is the reference.
    entry = {"file": "Clef-Test-Q8_0.gguf", "size_gb": 9.55, "sha256": sha256(Q8) if catalog_knows_sha else None}
    cat = Catalog.from_dict(catalog_dict(Q8_0=entry))
    bad = bytearray(Q8)
    bad[1000] ^= 0xFF
    fake_hub.repos[TOWER_REPO].corrupt["Clef-Test-Q8_0.gguf"] = bytes(bad)
    with pytest.raises(CorruptModel, match="sha256 mismatch") as err:
        hub.pull("clef-flash:Q8_0", catalog=cat, progress=False)
    assert sha256(Q8) in str(err.value) and sha256(bytes(bad)) in str(err.value)
    repo_dir = tmp_path / "hf" / "hub" / "models--test-org--clef-flash-GGUF"
    assert not (repo_dir / "snapshots" / TOWER_REV / "Clef-Test-Q8_0.gguf").exists()
    assert not any(p.stat().st_size == len(Q8) for p in (repo_dir / "blobs").iterdir())
    with pytest.raises(ModelNotFound):  # the bad file is gone, not silently served
        hub.resolve("clef-flash:Q8_0", catalog=cat)
    del fake_hub.repos[TOWER_REPO].corrupt["Clef-Test-Q8_0.gguf"]
    assert hub.pull("clef-flash:Q8_0", catalog=cat, progress=False).tower.read_bytes() == Q8


def test_file_on_the_hub_that_is_not_the_catalogs_is_refused_before_download(fake_hub):
    cat = Catalog.from_dict(catalog_dict(Q8_0={"file": "Clef-Test-Q8_0.gguf", "sha256": "0" * 64}))
    with pytest.raises(CorruptModel, match="not the catalog's file"):
        hub.pull("clef-flash:Q8_0", catalog=cat, progress=False)
    assert gets(fake_hub, "Clef-Test-Q8_0.gguf") == []  # HEAD only, no transfer


def test_a_cache_file_corrupted_later_is_caught_and_removed(fake_hub, cat):
    files = hub.pull("clef-flash:Q4_K_M", catalog=cat, progress=False)
    blob = files.tower.resolve()
    blob.write_bytes(b"GGUF" + b"\0" * (len(Q4) - 4))  # new mtime: the stamp no longer vouches for it
    with pytest.raises(CorruptModel):
        hub.resolve("clef-flash:Q4_K_M", catalog=cat)
    assert not blob.exists()


def test_unknown_names_list_what_exists(cat):
    with pytest.raises(ModelNotFound, match="known: clef-flash"):
        hub.pull("clef-huge:Q4_K_M", catalog=cat)
    with pytest.raises(ModelNotFound, match=r"unknown quant 'Q3_K_S'.*available: Q8_0, Q4_K_M, IQ2_XS"):
        hub.pull("clef-flash:Q3_K_S", catalog=cat)
    with pytest.raises(ModelNotFound, match="unknown source 'nobody'"):
        hub.pull("clef-flash:Q4_K_M@nobody", catalog=cat)
    with pytest.raises(ModelNotFound, match="has no Q8_0"):
        hub.pull("clef-flash:Q8_0@loose", catalog=cat)


def test_unpinned_source_finds_its_file_in_the_listing_and_pins_it(fake_hub, cat, monkeypatch):
    files = hub.pull("clef-flash:IQ2_XS", catalog=cat, progress=False)
    assert files.tower.name == "clef-flash-IQ2_XS.gguf" and files.tower.read_bytes() == IQ2
    assert files.revision.startswith(f"{LOOSE_REPO}@{LOOSE_REV}")
    assert files.name == "clef-flash:IQ2_XS@loose"
    [m] = [m for m in listing.list_local(catalog=cat) if m.source == "loose"]
    assert (m.quant, m.pinned, m.source_pinned, m.pinned_by, m.verified) == (
        "IQ2_XS", True, True, "first pull", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline, the file is found again from refs/main
    assert hub.resolve("clef-flash:IQ2_XS", catalog=cat).tower == files.tower


def test_auto_follows_the_device_policy(fake_hub, cat):
    assert hub.pull("clef-flash", catalog=cat, profile=BIG, progress=False).name == "clef-flash:Q8_0@testsrc"
    assert hub.pull("clef-flash:auto", catalog=cat, profile=SMALL, progress=False).name == "clef-flash:Q4_K_M@testsrc"
    tiny = DeviceProfile(total_ram=2 * GiB, available_ram=GiB)
    with pytest.raises(NoQuantFits, match="No clef-flash quant fits"):
        hub.pull("clef-flash", catalog=cat, profile=tiny)


def test_resolve_auto_prefers_a_cached_quant_that_fits(fake_hub, cat):
    hub.pull("clef-flash:Q4_K_M", catalog=cat, progress=False)
    before = len(fake_hub.requests)
    files = hub.resolve("clef-flash:auto", catalog=cat, profile=BIG)  # Q8_0 would fit, but is not cached
    assert files.name == "clef-flash:Q4_K_M@testsrc" and len(fake_hub.requests) == before
    assert hub.resolve("clef-flash", allow_download=True, catalog=cat, profile=BIG,
                       progress=False).name == "clef-flash:Q4_K_M@testsrc"


def test_resolve_auto_uses_a_quant_cached_from_a_non_default_source_from_that_source(fake_hub):
    data = catalog_dict()
    data["sources"]["loose"]["files"]["Q4_K_M"] = {"file": None, "size_gb": 5.84}
    cat = Catalog.from_dict(data)
    fake_hub.repos[LOOSE_REPO].commits[LOOSE_REV]["clef-flash-Q4_K_M.gguf"] = Q4
    pulled = hub.pull("clef-flash:Q4_K_M@loose", catalog=cat, progress=False)
    before = len(fake_hub.requests)
    # testsrc is the default source of Q4_K_M, but only loose's copy is cached
    files = hub.resolve("clef-flash:auto", catalog=cat, profile=SMALL)
    assert files.name == "clef-flash:Q4_K_M@loose" and files.tower == pulled.tower
    assert len(fake_hub.requests) == before


def test_resolve_auto_with_nothing_cached_says_what_to_pull(fake_hub, cat):
    with pytest.raises(ModelNotFound, match=r"clef-gguf pull clef-flash:Q8_0"):
        hub.resolve("clef-flash", catalog=cat, profile=BIG)


def test_a_native_file_that_cannot_be_split_is_refused_and_leaves_nothing(fake_hub, cat, tmp_path):
    # NATIVE is GGUF magic + noise: the split refuses it, and no model directory is left behind.
    # (tests/models/test_native.py pulls a real native GGUF and decides with it.)
    with pytest.raises(ConversionError, match="cannot split the native GGUF"):
        hub.pull("clef-flash:Q4_K_M@native", catalog=cat, progress=False)
    split = tmp_path / "hf" / "clef-gguf" / "split" / f"test-org--Native-GGUF@{NATIVE_REV}"
    assert not (split / "Q4_K_M").exists() and not [p for p in split.iterdir() if p.is_dir()]
    path = hub.pull_file("clef-flash:Q4_K_M@native", catalog=cat, progress=False)  # as it is
    assert path.read_bytes() == NATIVE and path.parent.name == NATIVE_REV


def test_cli_pull_and_list(fake_hub, tmp_path, monkeypatch, capsys):
    pull_parser, list_parser = cli_parsers(catalog_dict(), tmp_path, monkeypatch)

    assert commands.run_list(list_parser.parse_args([])) == 0
    assert "no Clef models" in capsys.readouterr().out
    assert commands.run_pull(pull_parser.parse_args(
        ["clef-flash", "--quant", "Q4_K_M", "--no-progress", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "clef-flash:Q4_K_M@testsrc" and out["tower"].endswith("Clef-Test-Q4_K_M.gguf")
    assert commands.run_pull(pull_parser.parse_args(["clef-flash:IQ2_XS", "--no-progress"])) == 0
    assert "no pinned revision" in capsys.readouterr().err
    assert commands.run_list(list_parser.parse_args([])) == 0
    text = capsys.readouterr().out
    assert "clef-flash:Q4_K_M@testsrc" in text and "ready, verified" in text
    assert "pinned at first pull" in text
    assert commands.run_list(list_parser.parse_args(["--json"])) == 0
    assert {m["quant"] for m in json.loads(capsys.readouterr().out)} == {"Q4_K_M", "IQ2_XS"}
    assert commands.run_list(list_parser.parse_args(["--available"])) == 0
    assert "clef-flash:Q8_0" in capsys.readouterr().out

