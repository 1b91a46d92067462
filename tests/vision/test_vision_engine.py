"""The vision engines (``clef_gguf.vision.engines``, ``--vision-engine``): ``exact`` is the module as built,
``int8`` quantizes the blocks' Linear layers and answers within the bound scripts/vision_bench.py measured
(docs/media.md, "Which vision encoder"); the cache keys name the engine; the flag reaches the model from
the command line, and a bad value is refused naming the field."""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from clef_gguf import Clef
from clef_gguf.cli import main
from clef_gguf.core import errors
from clef_gguf.core.limits import VISION_ENGINES
from clef_gguf.runtime.settings import LoadSettings
from clef_gguf.vision import VisionTower, engines
from clef_gguf.vision.cache import CachedVision, VisionCache, weights_identity
from clef_gguf.vision.model import Linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "media"))
from media_helpers import encode, picture, png_uri  # noqa: E402

QUESTIONS = {"cat": {"type": "noul", "instructions": "Is there a cat?"},
             "color": {"type": "choice", "criteria": {"red": None, "green": "Mostly green", "blue": None}},
             "busy": {"type": "score", "criteria": ["calm", "busy", "chaotic"]}}
# scripts/vision_bench.py --parity: int8 against exact, max |dp| 3.2e-5 to 4.5e-4 over 7 tiny releases
# (1.2e-4 on this one, tiny seed 0); the reference bar is 2e-3.
MAX_DP = 5e-4
# int8 against exact on the tiny tower's rows (its blocks are a small part of a residual): ~7e-4 relative.
MAX_ROWS_REL = 3e-3


def _inputs(tower: VisionTower, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor([[1, 6, 8], [1, 4, 4]])
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(dim=1).sum()), tower.config.patch_dim, generator=gen), grid


def _requests() -> list[dict]:
    return [{"state": "One small image.", "images": [png_uri(16, 16, 1)], "questions": QUESTIONS},
            {"state": "Two images.", "images": [png_uri(24, 32, 4), png_uri(48, 16, 5)], "questions": QUESTIONS},
            {"state": "A tall one that resizes.", "images": [png_uri(40, 100, 3)], "questions": QUESTIONS}]


def test_the_engine_names_have_one_home():
    assert VISION_ENGINES == ("exact", "int8") and engines.DEFAULT == "exact"
    assert typing.get_args(LoadSettings.model_fields["vision_engine"].annotation) == VISION_ENGINES
    assert LoadSettings().vision_engine == "exact"


def test_int8_quantizes_the_blocks_only_and_stays_close_to_exact(tiny_model_dir):
    exact = VisionTower.load(tiny_model_dir, threads=1)
    int8 = VisionTower.load(tiny_model_dir, threads=1, engine="int8")
    assert (exact.engine, int8.engine) == ("exact", "int8") and int8.dtype == torch.float32
    linears = [m for m in int8.model.blocks.modules() if isinstance(m, (nn.Linear, engines.DynamicInt8Linear))]
    assert linears and all(isinstance(m, engines.DynamicInt8Linear) for m in linears)
    # the patch embedding (raw pixels in) and the merger stay fp32
    assert type(int8.model.patch_embed.proj) is Linear and type(int8.model.merger.linear_fc2) is Linear
    assert not any(isinstance(m, engines.DynamicInt8Linear) for m in exact.model.modules())
    for seed in range(3):
        pixels, grid = _inputs(exact, seed)
        want, got = exact.embed(pixels, grid), int8.embed(pixels, grid)
        assert got.dtype == torch.float32 and got.shape == want.shape and bool(torch.isfinite(got).all())
        rel = float((got - want).norm() / want.norm())
        assert 0 < rel <= MAX_ROWS_REL, rel  # really quantized, and close


@pytest.mark.parametrize("reduce_range", [True, False])
def test_both_activation_ranges_run(tiny_model_dir, reduce_range):
    exact = VisionTower.load(tiny_model_dir, threads=1)
    pixels, grid = _inputs(exact)
    want = exact.embed(pixels, grid)
    for per_channel in (True, False):
        tower = VisionTower.load(tiny_model_dir, threads=1)
        engines.quantize_blocks(tower.model, per_channel=per_channel, reduce_range=reduce_range)
        got = tower.embed(pixels, grid)
        assert float((got - want).norm() / want.norm()) <= 2 * MAX_ROWS_REL


def test_int8_answers_are_within_the_measured_bound_of_exact(tiny_model_dir):
    with Clef.load(tiny_model_dir, threads=1, state_cache_mb=0) as exact, \
            Clef.load(tiny_model_dir, threads=1, state_cache_mb=0, vision_engine="int8") as int8:
        assert (exact.info["vision_engine"], int8.info["vision_engine"]) == ("exact", "int8")
        assert int8.info["vision"] == "images, videos"
        worst = 0.0
        for request in _requests():
            for got, want in zip(int8.probabilities(request), exact.probabilities(request)):
                worst = max(worst, float(np.abs(got - want).max()))
                top = np.sort(want)[::-1]
                if top[0] - top[1] > 0.01:
                    assert int(np.argmax(got)) == int(np.argmax(want))
            assert int8.media.vision().engine == "int8"
        text = {"state": "No pictures.", "questions": QUESTIONS}  # the vision engine has no say in text
        assert int8.decide(text)["answers"] == exact.decide(text)["answers"]
    assert 0 < worst <= MAX_DP, worst


def test_the_cache_key_names_the_engine(tiny_model_dir):
    exact = VisionTower.load(tiny_model_dir, threads=1)
    int8 = VisionTower.load(tiny_model_dir, threads=1, engine="int8")
    weights = weights_identity(exact.files, lambda _p: None)
    shared = VisionCache(1 << 20)
    by_exact, by_int8 = CachedVision(exact, shared, weights), CachedVision(int8, shared, weights)
    pixels, grid = _inputs(exact)
    assert by_exact.key(pixels, grid) != by_int8.key(pixels, grid)
    made = by_exact.embed(pixels, grid)
    assert not made.cached and by_exact.embed(pixels, grid).cached
    got = by_int8.embed(pixels, grid)  # exact's entry is not int8's
    assert not got.cached and not torch.equal(got.rows, made.rows) and len(shared) == 2
    assert by_int8.embed(pixels, grid).cached


def test_bad_values_are_refused_naming_the_field(tiny_model_dir, capsys):
    for bad in ("fp16", "INT8", "", 8):
        with pytest.raises(errors.InvalidSetting) as exc:
            LoadSettings.of(vision_engine=bad)
        assert exc.value.field == "vision_engine" and "vision_engine" in exc.value.message
    with pytest.raises(errors.InvalidSetting) as exc:
        Clef.load(tiny_model_dir, threads=1, vision_engine="onnx")
    assert exc.value.field == "vision_engine"
    with pytest.raises(errors.InvalidSetting) as exc:
        LoadSettings.from_strings({"model": "m", "vision_engine": "fast"})
    assert LoadSettings.from_strings({"model": "m", "vision_engine": "int8"}).vision_engine == "int8"
    with pytest.raises(errors.InvalidSetting) as exc:
        VisionTower.load(tiny_model_dir, engine="fast")
    assert exc.value.field == "vision_engine"
    with pytest.raises(errors.InvalidSetting) as exc:  # int8 quantizes an fp32 tower
        VisionTower.load(tiny_model_dir, dtype=torch.bfloat16, engine="int8")
    assert exc.value.field == "vision_engine"
    with pytest.raises(SystemExit) as exit_:
        main(["decide", "-m", str(tiny_model_dir), "--vision-engine", "fast"])
    assert exit_.value.code == 2 and "--vision-engine" in capsys.readouterr().err


def test_the_help_shows_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["decide", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--vision-engine {exact,int8}" in out and "how the vision tower runs" in out
    assert "reference's numerics" in out and "dynamic int8" in out


def test_decide_on_a_picture_with_the_int8_engine(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(encode(picture(40, 24, 7)))
    request = {"state": "A picture.", "questions": QUESTIONS, "images": [str(tmp_path / "a.png")]}
    (tmp_path / "request.json").write_text(json.dumps(request))
    assert main(["decide", "-m", str(tiny_model_dir), "-r", str(tmp_path / "request.json"), "--threads", "1",
                 "--vision-engine", "int8"]) == 0
    got = json.loads(capsys.readouterr().out)
    with Clef.load(tiny_model_dir, threads=1, vision_engine="int8") as int8:
        want = int8.decide(request)
    assert got["answers"] == want["answers"] and got["usage"] == want["usage"]
