"""The vision cache (``clef_gguf.vision.cache``): a picture seen before is not run through the vision tower
again whatever state comes with it, with the answer a cold process gives; the byte bound and its LRU;
0 turns it off; another picture, dtype or set of weights misses; ``usage.cached_media_tokens``, named
only when the vision tower's output was reused."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from clef_gguf import Clef
from clef_gguf.server.schema import SystemOneResponse
from clef_gguf.vision import VISION_WEIGHTS, VisionModel, VisionTower
from clef_gguf.vision.cache import CachedVision, VisionCache, weights_identity

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "media"))
from media_helpers import png_uri  # noqa: E402

QUESTIONS = {"colour": {"type": "choice", "criteria": {"red": None, "green": None, "blue": None}},
             "urgent": {"type": "noul"}}
CACHE_KEYS = ("cached_tokens", "cached_media_tokens")
PLAIN_USAGE = {"input_tokens", "output_tokens", "cached_tokens"}  # the reference's


def request(state: str, *images: str) -> dict:
    return {"state": state, "questions": QUESTIONS, "images": list(images)}


def without_caches(response: dict) -> dict:
    """All a response says but what the caches held."""
    return response | {"usage": {k: v for k, v in response["usage"].items() if k not in CACHE_KEYS}}


@pytest.fixture
def tower_runs(monkeypatch) -> list[int]:
    """Every run of the vision tower's forward (its patch count), in order."""
    runs: list[int] = []
    forward = VisionModel.forward

    def counted(self, pixel_values, grid_thw):
        runs.append(int(pixel_values.shape[0]))
        return forward(self, pixel_values, grid_thw)

    monkeypatch.setattr(VisionModel, "forward", counted)
    return runs


def rows(n: int, width: int = 16) -> torch.Tensor:
    return torch.zeros((n, width), dtype=torch.float32)


# ---------------------------------------------------------------- the bounded LRU
def test_eviction_keeps_the_byte_bound_least_recently_used_first():
    entry = rows(4).nelement() * 4  # 256 bytes
    cache = VisionCache(3 * entry)
    for key in (b"a", b"b", b"c"):
        assert cache.put(key, rows(4))
    assert cache.nbytes == 3 * entry and len(cache) == 3
    assert cache.get(b"a") is not None  # a is now the most recent: b goes first
    assert cache.put(b"d", rows(4))
    assert b"b" not in cache and all(k in cache for k in (b"a", b"c", b"d"))
    assert cache.put(b"e", rows(8))  # twice as big: the two least recent make room
    assert b"c" not in cache and b"a" not in cache and b"d" in cache and cache.nbytes == 3 * entry
    assert not cache.put(b"huge", rows(13)) and b"huge" not in cache  # over the whole budget: not kept
    assert cache.put(b"d", rows(4)) and b"e" in cache and cache.nbytes == 3 * entry  # replaced, not added
    assert (cache.hits, cache.misses) == (1, 0) and cache.get(b"c") is None and cache.misses == 1
    cache.clear()
    assert (len(cache), cache.nbytes) == (0, 0)


def test_zero_bytes_keeps_nothing():
    cache = VisionCache(0)
    assert not cache.put(b"a", rows(1)) and len(cache) == 0


# ---------------------------------------------------------------- the keys, on the tiny vision tower
def _inputs(tower: VisionTower, h: int, w: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor([[1, h, w]])
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((h * w, tower.config.patch_dim), generator=gen), grid


def test_a_hit_is_the_towers_own_output_and_anything_else_misses(tiny_model_dir, tower_runs):
    tower = VisionTower.load(tiny_model_dir, threads=1)
    weights = weights_identity(tower.files, lambda _p: None)
    cached = CachedVision(tower, VisionCache(1 << 20), weights)
    pixels, grid = _inputs(tower, 4, 6, 0)
    first = cached.embed(pixels, grid)
    again = cached.embed(pixels.clone(), grid.clone())  # equal values, other tensors
    assert not first.cached and again.cached and again.cached_tokens == len(again.rows) == 6
    assert torch.equal(again.rows, tower.embed(pixels, grid)) and len(tower_runs) == 2  # the check's run
    # one pixel, the grid's shape, the dtype or the weights: another key
    other = pixels.clone()
    other[0, 0] += 1e-6
    assert not cached.embed(other, grid).cached
    assert not cached.embed(pixels, torch.tensor([[1, 6, 4]])).cached
    bf16 = CachedVision(VisionTower.load(tiny_model_dir, dtype=torch.bfloat16, threads=1), cached.cache, weights)
    assert bf16.key(pixels, grid) != cached.key(pixels, grid)
    elsewhere = CachedVision(tower, cached.cache, weights_identity(tower.files, lambda _p: "0" * 64))
    assert elsewhere.key(pixels, grid) != cached.key(pixels, grid)


def test_the_weights_identity_is_the_recorded_hash_or_the_file(tiny_model_dir, tmp_path):
    tower = VisionTower.load(tiny_model_dir, threads=1)
    assert tower.files == (tiny_model_dir / VISION_WEIGHTS,)
    recorded = weights_identity(tower.files, lambda _p: "ab" * 32)
    assert recorded == weights_identity(tower.files, lambda _p: "ab" * 32) \
        != weights_identity(tower.files, lambda _p: "cd" * 32)
    copy = tmp_path / VISION_WEIGHTS
    copy.write_bytes(tower.files[0].read_bytes())
    unrecorded = weights_identity([copy], lambda _p: None)
    assert unrecorded == weights_identity([copy], lambda _p: None) != recorded
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))  # the file changed
    assert weights_identity([copy], lambda _p: None) != unrecorded


# ---------------------------------------------------------------- whole requests
@pytest.fixture(scope="module")
def clef(tiny_model_dir):
    with Clef.load(tiny_model_dir, threads=1, max_length=2048) as loaded:
        yield loaded


def test_another_state_about_the_same_picture_does_not_run_the_tower(clef, tiny_model_dir, tower_runs):
    picture = png_uri(48, 40, seed=21)
    first = clef.decide(request("What colour is this photo?", picture))
    assert len(tower_runs) == 1 and set(first["usage"]) == PLAIN_USAGE  # computed: nothing to say
    second = request("A different state: is anything urgent in it?", picture)
    got = clef.decide(second)
    assert len(tower_runs) == 1  # the vision cache answered; the state cache could not (another state)
    media_tokens = clef.prepare(second).encoded.media.n_tokens
    assert got["usage"]["cached_media_tokens"] == media_tokens > 0
    assert SystemOneResponse.model_validate(got).usage.cached_media_tokens == media_tokens  # the wire contract
    assert got["usage"]["cached_tokens"] < got["usage"]["input_tokens"]  # the state was decoded
    with Clef.load(tiny_model_dir, threads=1, max_length=2048) as cold:
        fresh = cold.decide(second)
    assert len(tower_runs) == 2 and set(fresh["usage"]) == PLAIN_USAGE
    assert json.dumps(without_caches(got)) == json.dumps(without_caches(fresh))  # byte for byte
    # the same prompt again: restored whole by the state cache, every media token cached
    assert clef.decide(second)["usage"]["cached_media_tokens"] == media_tokens and len(tower_runs) == 2


def test_another_picture_misses(clef, tower_runs):
    clef.decide(request("Look.", png_uri(32, 32, seed=1)))
    got = clef.decide(request("Look again.", png_uri(32, 32, seed=2)))
    assert len(tower_runs) == 2 and set(got["usage"]) == PLAIN_USAGE


def test_text_only_answers_have_no_media_usage(clef):
    assert set(clef.decide({"state": "text", "questions": QUESTIONS})["usage"]) == PLAIN_USAGE


def test_zero_turns_it_off(tiny_model_dir, tower_runs):
    picture = png_uri(40, 40, seed=4)
    with Clef.load(tiny_model_dir, threads=1, vision_cache_mb=0) as clef:
        clef.decide(request("One state.", picture))
        got = clef.decide(request("Another state.", picture))
        assert len(tower_runs) == 2 and set(got["usage"]) == PLAIN_USAGE
        assert clef.media.cache is not None and len(clef.media.cache) == 0


def test_the_budget_bounds_the_pictures_kept(tiny_model_dir, tower_runs):
    a, b = png_uri(64, 64, seed=5), png_uri(64, 64, seed=6)
    with Clef.load(tiny_model_dir, threads=1, state_cache_mb=0) as clef:
        clef.decide(request("first", a))
        cache = clef.media.cache
        assert cache is not None and len(cache) == 1
        one = cache.nbytes
    # room for one picture's output: b evicts a, so a runs the tower again
    with Clef.load(tiny_model_dir, threads=1, state_cache_mb=0, vision_cache_mb=1.5 * one / (1 << 20)) as clef:
        tower_runs.clear()
        for state, picture in (("first", a), ("second", b), ("third", a)):
            clef.decide(request(state, picture))
        assert len(tower_runs) == 3 and len(clef.media.cache) == 1 and clef.media.cache.nbytes == one
        assert clef.decide(request("fourth", a))["usage"]["cached_media_tokens"] > 0 and len(tower_runs) == 3
