"""``clef-flash:NVFP4A16-GGUF``: no one publishes an NVFP4 GGUF, so the name pulls the checkpoint (a real
tiny one, served by a local fake Hub) and re-encodes it once into the cache (``models/nvfp4_materialize.py``):
atomic, under a lock, reused by the next resolve, made again when the snapshot changes."""

from __future__ import annotations

import pytest

from _fakehub import FakeHub, head_source, point_at
from clef_gguf import Clef
from clef_gguf.models import hub
from clef_gguf.models.catalog import Catalog
from test_checkpoint import checkpoint_source, packaged

HEAD_REPO, REPO, HEAD_REV, COMMIT = "test-org/clef-flash", "test-org/clef-flash-NVFP4A16", "b" * 40, "c" * 40
REQUEST = {"state": "Invoice INV-7 is 40 days past due.", "questions": {"overdue": {"type": "noul"}}}


@pytest.fixture
def served(tiny_nvfp4_dir, tmp_path, monkeypatch):
    checkpoint = tiny_nvfp4_dir("nvfp4a16")
    repo = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()}
    head = {k: repo[k] for k in ("joint_head.safetensors", "joint_head_config.json", "tokenizer.json")}
    server = FakeHub()
    server.add(HEAD_REPO, HEAD_REV, head)
    server.add(REPO, COMMIT, repo)
    server.start()
    point_at(monkeypatch, server, tmp_path / "hf")
    data = packaged()
    family = data["families"]["clef-flash"]
    family.update(head_source="head", tower_sources=[], other_sources=["w4a16"])
    cat = Catalog.from_dict({"format": "clef-gguf-catalog/1", "quant_types": data["quant_types"],
                             "checkpoint_files": data["checkpoint_files"], "families": {"clef-flash": family},
                             "sources": {"head": head_source(HEAD_REPO, HEAD_REV, head),
                                         "w4a16": checkpoint_source("nvfp4a16", REPO, "NVFP4A16", "W4A16", COMMIT)}})
    yield cat
    server.stop()


def test_the_name_pulls_the_checkpoint_and_re_encodes_it_once(served, tmp_path):
    found = hub.resolve("clef-flash:nvfp4a16-gguf", catalog=served, allow_download=True, progress=False)
    assert found.backend == "gguf" and found.tower.name == "tower-nvfp4-gguf.gguf"
    assert found.tower.is_relative_to(tmp_path / "hf" / "clef-gguf" / "nvfp4-gguf")
    assert "re-encoded as NVFP4 GGUF" in found.revision
    with Clef.load(found.tower.parent) as clef:
        assert clef.decide(REQUEST)["audit"]["precision"] == "nvfp4"
    made = found.tower.stat().st_mtime_ns
    again = hub.resolve("clef-flash:NVFP4A16-GGUF", catalog=served, progress=False)  # offline now: cached
    assert again.tower == found.tower and again.tower.stat().st_mtime_ns == made
    # a conversion killed half-way left a stage: the next one under the lock clears it
    stage = found.tower.parent.parent / f".{found.tower.parent.name}.partial-killed"
    stage.mkdir()
    found.tower.parent.joinpath("clef-gguf.json").unlink()  # and the directory is incomplete: made again
    third = hub.resolve("clef-flash:NVFP4A16-GGUF", catalog=served, progress=False)
    assert third.tower.is_file() and not stage.exists()


def test_the_checkpoint_itself_is_still_the_reference_exact_path(served):
    found = hub.resolve("clef-flash:nvfp4a16", catalog=served, allow_download=True, progress=False)
    assert found.backend == "nvfp4"
