"""The vision part of a catalog model: pull takes only the vision tensors of the release's shards (byte
ranges from a fake Hub, huggingface_hub's real code), and images then answer as on the converted model."""

from __future__ import annotations

import base64
import io
import json
import shutil
import struct

import numpy as np
import PIL.Image
import pytest
from safetensors.torch import load_file

from _fakehub import FakeHub, cli_parsers, point_at, tiny_catalog
from clef_gguf import Clef
from clef_gguf.convert.synthetic.tiny import build_release
from clef_gguf.core.errors import CorruptModel, ModelNotFound
from clef_gguf.formats.files import VISION_CONFIG, VISION_WEIGHTS
from clef_gguf.models import hub
from clef_gguf.pick import catalog_commands as commands
from clef_gguf.models.catalog import CATALOG_ENV

TOWER_REPO, HEAD_REPO = "test-org/clef-flash-GGUF", "test-org/clef-flash"
TOWER_REV, HEAD_REV = "e" * 40, "f" * 40
HEAD_FILES = ("joint_head.safetensors", "joint_head_config.json", "tokenizer.json")
QUESTIONS = {"cat": {"type": "noul", "instructions": "Is there a cat?"},
             "busy": {"type": "score", "criteria": ["calm", "busy", "chaotic"]}}


def png_uri(width: int, height: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


REQUEST = {"state": "Look at the picture.", "images": [png_uri(40, 24, 3)], "questions": QUESTIONS}


def catalog(head: dict[str, bytes], tower: bytes) -> dict:
    return tiny_catalog(head, tower, HEAD_REPO, HEAD_REV, TOWER_REPO, TOWER_REV)


@pytest.fixture
def release(tmp_path):
    """The tiny release (the converted tiny model's seed) in three shards, with an index."""
    return build_release(tmp_path / "release", preset="tiny", seed=0, shards=3)


@pytest.fixture
def vision_hub(tiny_model_dir, release, tmp_path, monkeypatch):
    tower = (tiny_model_dir / "tower-f32.gguf").read_bytes()
    head = {name: (tiny_model_dir / name).read_bytes() for name in HEAD_FILES}
    files = {p.name: p.read_bytes() for p in release.iterdir() if p.is_file()} | head
    server = FakeHub()
    server.add(TOWER_REPO, TOWER_REV, {"Clef-Tiny-Q8_0.gguf": tower})
    server.add(HEAD_REPO, HEAD_REV, files)
    server.start()
    point_at(monkeypatch, server, tmp_path / "hf")
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(catalog(head, tower)))
    monkeypatch.setenv(CATALOG_ENV, str(path))
    yield server
    server.stop()


def _vision_bytes(shard: bytes) -> tuple[int, int]:
    """(header bytes incl. its length, bytes of model.visual.* tensors) of a safetensors file."""
    (n,) = struct.unpack("<Q", shard[:8])
    header = json.loads(shard[8:8 + n])
    return 8 + n, sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                      if k.startswith("model.visual."))


def _answers(model) -> dict:
    with Clef.load(model, state_cache_mb=0, threads=2) as clef:
        assert clef.info["vision"] == "images, videos"
        out = clef.decide(REQUEST)
    return {"answers": out["answers"], "input_tokens": out["usage"]["input_tokens"]}


def test_pull_takes_only_the_vision_tensors_and_images_answer_as_converted(vision_hub, release, tiny_model_dir,
                                                                          monkeypatch):
    files = hub.pull("clef-flash:Q8_0", progress=False)
    assert files.vision is not None and files.vision.is_dir()
    assert json.loads((files.vision / VISION_CONFIG).read_text()) == \
        json.loads((release / "config.json").read_text())["vision_config"]
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        assert (files.vision / name).read_bytes() == (release / name).read_bytes()
    ours, converted = load_file(files.vision / VISION_WEIGHTS), load_file(tiny_model_dir / VISION_WEIGHTS)
    assert ours.keys() == converted.keys()
    assert all(ours[k].dtype == converted[k].dtype and ours[k].equal(converted[k]) for k in ours)

    # Only the header and the vision tensors' bytes of the one shard the index names for them.
    shards = sorted(p.name for p in release.glob("model-*.safetensors"))
    with_vision = [s for s in shards if _vision_bytes((release / s).read_bytes())[1]]
    assert len(with_vision) == 1 and len(shards) == 3
    header, vision = _vision_bytes((release / with_vision[0]).read_bytes())
    assert vision_hub.served.get(with_vision[0]) == header + vision
    assert vision_hub.served[with_vision[0]] < (release / with_vision[0]).stat().st_size / 2
    assert not any(vision_hub.served.get(s) for s in shards if s not in with_vision)

    before = len(vision_hub.requests)
    assert hub.pull("clef-flash:Q8_0", progress=False).vision == files.vision  # cached: no request
    assert len(vision_hub.requests) == before

    expected = _answers(tiny_model_dir)
    assert _answers("clef-flash:Q8_0") == expected

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # --offline: the cache alone
    vision_hub.fail_all = True
    assert hub.resolve("clef-flash:Q8_0").vision == files.vision
    assert _answers("clef-flash:Q8_0") == expected
    assert len(vision_hub.requests) == before


def test_a_damaged_vision_file_is_refused_and_pulled_again(vision_hub):
    files = hub.pull("clef-flash:Q8_0", progress=False)
    weights = files.vision / VISION_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptModel, match="sha256 mismatch"):
        hub.resolve("clef-flash:Q8_0")
    assert not weights.exists()  # removed: never used
    assert hub.resolve("clef-flash:Q8_0").vision is None  # the cache alone: no vision part now
    again = hub.pull("clef-flash:Q8_0", progress=False)
    assert (again.vision / VISION_WEIGHTS).read_bytes() != bytes(data)


def test_without_network_a_missing_vision_part_fails_the_pull_and_offline_goes_without(vision_hub, monkeypatch):
    files = hub.pull("clef-flash:Q8_0", progress=False)
    shutil.rmtree(files.vision)  # as a cache from before vision parts were pulled
    vision_hub.fail_all = True
    with pytest.raises(ModelNotFound, match="failed"):
        hub.pull("clef-flash:Q8_0", progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = hub.resolve("clef-flash:Q8_0")
    assert offline.vision is None and offline.tower == files.tower


def test_a_text_only_release_pulls_without_a_vision_part(vision_hub):
    del vision_hub.repos[HEAD_REPO].commits[HEAD_REV]["config.json"]
    files = hub.pull("clef-flash:Q8_0", progress=False)
    assert files.vision is None
    before = len(vision_hub.requests)
    assert hub.pull("clef-flash:Q8_0", progress=False).vision is None  # remembered: no request
    assert len(vision_hub.requests) == before
    assert not any(".safetensors" in p and "joint_head" not in p for _, p in vision_hub.requests)


def test_cli_pull_names_the_vision_part(vision_hub, tiny_model_dir, tmp_path, monkeypatch, capsys):
    head = {name: (tiny_model_dir / name).read_bytes() for name in HEAD_FILES}
    tower = (tiny_model_dir / "tower-f32.gguf").read_bytes()
    pull_parser, _ = cli_parsers(catalog(head, tower), tmp_path, monkeypatch)
    assert commands.run_pull(pull_parser.parse_args(["clef-flash:Q8_0", "--no-progress", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["vision"] == str(hub.resolve("clef-flash:Q8_0").vision)
    assert commands.run_pull(pull_parser.parse_args(["clef-flash:Q8_0", "--no-progress"])) == 0
    assert f"vision        {out['vision']}" in capsys.readouterr().out
