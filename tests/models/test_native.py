"""A native clef-arch GGUF (head inside) served by a fake Hub: ``pull`` / ``decide --model`` split
it on download into a model directory under ``$HF_HOME/clef-gguf/split/``, once, and decide with it.

The native file is written from the tiny q8_0 model by tests/convert/test_split.py's
``write_native`` (upstream's layout, independent of convert/split.py's tables)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from _fakehub import FakeHub, point_at, sha256
from clef_gguf import Clef
from clef_gguf.formats import files as model_files
from clef_gguf.convert import split as split_module
from clef_gguf.core.errors import PinMismatch
from clef_gguf.models import hfcache, hub, listing, pins
from clef_gguf.pick import catalog_commands as commands
from clef_gguf.models.catalog import CATALOG_ENV, Catalog

NATIVE_REPO, HEAD_REPO = "test-org/Clef-Tiny-GGUF", "test-org/clef-tiny"
NATIVE_REV, NATIVE_REV2, HEAD_REV = "9" * 40, "7" * 40, "8" * 40
FILE, NAME = "Clef-Tiny-Q8_0.gguf", "clef-flash:Q8_0@ggml-org"


def _split_test_module():
    path = Path(__file__).resolve().parents[1] / "convert" / "test_split.py"
    spec = importlib.util.spec_from_file_location("_native_gguf_writer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_WRITER = _split_test_module()
REQUEST = _WRITER.REQUESTS[0]  # noul + choice + score


@pytest.fixture(scope="module")
def native(tiny_model_dir_factory, tmp_path_factory):
    q8 = tiny_model_dir_factory("q8_0")
    path = _WRITER.write_native(q8, tmp_path_factory.mktemp("native") / "clef-tiny-q8_0.gguf")
    return q8, path.read_bytes()


def catalog_dict(data: bytes, revision: str | None = NATIVE_REV) -> dict:
    """Only a native source carries quants; the head repo is listed (the schema wants one) but never
    served: a native pull must not need it."""
    return {
        "format": "clef-gguf-catalog/1",
        "quant_types": {"order": ["Q8_0"], "bpw": {"Q8_0": 8.5}},
        "families": {
            "clef-flash": {
                "architecture": {
                    "hidden_size": 64,
                    "layers": 4,
                    "recurrent_layers": 3,
                    "attention_layers": 1,
                    "attention_heads": 4,
                    "kv_heads": 2,
                    "head_dim": 16,
                    "vocab_size": 512,
                    "max_context": 32768,
                },
                "memory": {
                    "kv_bytes_per_token": 128,
                    "recurrent_bytes_per_sequence": 65536,
                    "head_bytes": 1 << 20,
                    "activation_bytes_per_token": 64,
                    "compute_bytes": 1 << 20,
                    "runtime_bytes": 1 << 20,
                },
                "size_estimate": {"overhead_bytes": 0, "bytes_per_bpw": 1},
                "head_source": "head",
                "tower_sources": [],
                "other_sources": ["native"],
            }
        },
        "sources": {
            "head": {
                "family": "clef-flash",
                "alias": "cloudflare",
                "role": "head",
                "repo": HEAD_REPO,
                "revision": HEAD_REV,
                "files": {
                    "head_weights": {"file": "joint_head.safetensors"},
                    "head_config": {"file": "joint_head_config.json"},
                    "tokenizer": {"file": "tokenizer.json"},
                },
            },
            "native": {
                "family": "clef-flash",
                "alias": "ggml-org",
                "role": "native",
                "repo": NATIVE_REPO,
                "revision": revision,
                "files": {
                    "Q8_0": {
                        "file": FILE,
                        "size": len(data),
                        "sha256": sha256(data) if revision else None,
                    }
                },
            },
        },
    }


@pytest.fixture
def native_hub(native, tmp_path, monkeypatch):
    _, data = native
    server = FakeHub()
    server.add(NATIVE_REPO, NATIVE_REV, {FILE: data, "README.md": b"native"})
    server.start()
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(catalog_dict(data)))
    env = {"HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "hf"), CATALOG_ENV: str(path)}
    point_at(monkeypatch, server, tmp_path / "hf")
    monkeypatch.setenv(CATALOG_ENV, str(path))
    server.env, server.data = env, data
    yield server
    server.stop()


@pytest.fixture
def splits(monkeypatch):
    """Counts the splits hub runs (it imports split_native from the module at call time)."""
    calls = []
    original = split_module.split_native

    def counting(src, out, **kwargs):
        calls.append(Path(out))
        return original(src, out, **kwargs)

    monkeypatch.setattr(split_module, "split_native", counting)
    return calls


def split_path(commit=NATIVE_REV) -> Path:
    return hfcache.split_dir(NATIVE_REPO, commit, "Q8_0")


def test_decide_with_a_native_source_splits_on_download_and_decides(native, native_hub):
    q8, _ = native
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))
    } | native_hub.env
    proc = subprocess.run(
        ["clef-gguf", "decide", "--model", NAME, "--threads", "2"],
        input=json.dumps(REQUEST),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["model"] == NAME
    with Clef.load(q8, threads=2) as reference:  # the model the native file was written from
        assert answer["answers"] == reference.decide(REQUEST)["answers"]
    downloads = [p for m, p in native_hub.requests if m == "GET" and "/resolve/" in p]
    assert downloads == [f"/{NATIVE_REPO}/resolve/{NATIVE_REV}/{FILE}"]  # no head repo, no README
    out = split_path()
    manifest = model_files.read_manifest(out)
    assert manifest["name"] == NAME and manifest["source"]["format"] == "native-clef-gguf"
    assert manifest["source"]["tokenizer"] == "gguf"  # rebuilt from the GGUF's own vocabulary
    assert answer["audit"]["model_hash"] == manifest["files"][manifest["tower"]]["sha256"]
    assert not [
        p for p in out.parent.iterdir() if p.name.startswith(".") and p.is_dir()
    ]  # no stage left


def test_the_split_is_made_once_reused_and_redone_when_its_source_changes(
    native_hub, splits, monkeypatch
):
    stale = split_path().parent / ".Q8_0.split-killed"  # the stage of a split killed half-way
    stale.mkdir(parents=True)
    (stale / "tower-q8_0.gguf").write_bytes(b"GGUF half")
    files = hub.pull(NAME, progress=False)
    out = split_path()
    assert not stale.exists()
    assert files.tower.parent == out and files.tower.name == "tower-q8_0.gguf"
    assert files.name == NAME and files.revision.startswith(f"{NATIVE_REPO}@{NATIVE_REV}")
    assert splits == [out]
    files.check_exist()
    [local] = listing.list_local()
    assert (local.name, local.head_ready, local.verified, local.pinned_by) == (
        NAME,
        True,
        True,
        "catalog",
    )

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # reused: no network, no second split
    native_hub.fail_all = True
    again = hub.resolve(NAME)
    assert again.tower == files.tower and len(splits) == 1
    assert again.known_sha256(again.tower) == files.known_sha256(
        files.tower
    )  # hashes from the manifest

    blob = (hfcache.repo_dir(NATIVE_REPO) / "snapshots" / NATIVE_REV / FILE).resolve()
    st = blob.stat()
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns + 10**10))  # the source blob was rewritten
    hub.resolve(NAME)
    assert len(splits) == 2 and split_path().is_dir()

    (out / model_files.TOKENIZER).unlink()  # an incomplete directory is never used
    assert not listing.list_local()[0].head_ready
    assert hub.resolve(NAME).tokenizer.is_file() and len(splits) == 3


def test_cli_pull_of_a_native_source_says_it_splits(native_hub, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    commands.add_pull_arguments(parser)
    assert commands.run_pull(parser.parse_args([NAME, "--no-progress", "--json"])) == 0
    captured = capsys.readouterr()
    assert "split once" in captured.err
    out = json.loads(captured.out)
    assert out["tower"] == str(split_path() / "tower-q8_0.gguf")
    assert out["tokenizer"] == str(split_path() / model_files.TOKENIZER)


def test_a_native_source_without_a_revision_is_pinned_and_split_per_commit(
    native_hub, splits, tmp_path
):
    cat = Catalog.from_dict(catalog_dict(native_hub.data, revision=None))
    first = hub.pull(NAME, catalog=cat, progress=False)
    assert first.tower.parent == split_path() and pins.pin(NATIVE_REPO)["commit"] == NATIVE_REV

    native_hub.add(NATIVE_REPO, NATIVE_REV2, {FILE: native_hub.data})
    with pytest.raises(PinMismatch, match="--update"):
        hub.pull(NAME, catalog=cat, progress=False)
    assert hub.resolve(NAME, catalog=cat).tower == first.tower and len(splits) == 1

    moved = hub.pull(NAME, catalog=cat, progress=False, update=True)
    assert moved.tower.parent == split_path(NATIVE_REV2) and len(splits) == 2
    assert hub.resolve(NAME, catalog=cat).tower == moved.tower
