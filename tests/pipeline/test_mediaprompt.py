"""Media in the tower: M-RoPE positions as the reference's ``get_rope_index``, runs of embeddings
decoded at their place with those positions (against transformers' language model fed the same
embeddings), exact reuse, and cache keys that tell two pictures apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clef_gguf.pipeline.mediaprompt import MediaPrompt, MediaRows, Run, positions
from clef_gguf.tower.cache import StateCache
from clef_gguf.tower.llama_tower import Tower


def _reference_positions(model, n_tokens: int, runs: list[Run], kinds: list[int]) -> np.ndarray:
    """transformers' ``get_rope_index`` on a prompt with these runs (1: image, 2: video pair)."""
    types = torch.zeros((1, n_tokens), dtype=torch.int32)
    for run, kind in zip(runs, kinds):
        types[0, run.start:run.end] = kind
    merge = model.config.vision_config.spatial_merge_size
    grids = {k: torch.tensor([[1, r.rows * merge, r.cols * merge] for r, kk in zip(runs, kinds) if kk == k])
             for k in (1, 2)}
    ids = torch.zeros((1, n_tokens), dtype=torch.long)
    pos, _ = model.model.get_rope_index(ids, types, image_grid_thw=grids[1] if len(grids[1]) else None,
                                        video_grid_thw=grids[2] if len(grids[2]) else None)
    return pos[:, 0].numpy()


@pytest.mark.parametrize("layout", [
    [(10, 2, 3, 1)],  # one wide image
    [(5, 4, 2, 1), (20, 1, 1, 1)],  # a tall image and a one-token image
    [(3, 2, 2, 2), (10, 2, 2, 2), (18, 3, 1, 1)],  # two video frame pairs, then an image
])
def test_positions_are_the_references(tiny_hf_model, layout):
    runs, kinds, at = [], [], 0
    for gap, rows, cols, kind in layout:
        at += gap
        runs.append(Run(at, at + rows * cols, rows, cols))
        kinds.append(kind)
        at += rows * cols
    n = at + 7
    assert np.array_equal(positions(n, runs), _reference_positions(tiny_hf_model, n, runs, kinds))


def test_pieces_cut_a_range_at_the_runs():
    media = MediaPrompt((Run(4, 10, 2, 3), Run(12, 14, 1, 2)), positions(20, [Run(4, 10, 2, 3), Run(12, 14, 1, 2)]),
                        "d", lambda: MediaRows(np.zeros((8, 2), np.float32), 0))
    assert media.pieces(0, 20) == [(0, 4, None), (4, 10, 0), (10, 12, None), (12, 14, 6), (14, 20, None)]
    assert media.pieces(6, 13) == [(6, 10, 2), (10, 12, None), (12, 13, 6)]
    assert media.pieces(15, 18) == [(15, 18, None)]


@pytest.fixture(scope="module")
def tower(tiny_model_dir):
    with Tower.load(next(tiny_model_dir.glob("tower-*.gguf")), n_ctx=2048, threads=2, n_batch=16) as t:
        yield t


def _prompt(tower: Tower, seed: int, runs: list[Run], n: int) -> tuple[np.ndarray, MediaPrompt, list[int]]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, 400, n).astype(np.int32)
    rows = rng.standard_normal((sum(r.n_tokens for r in runs), tower.n_embd)).astype(np.float32) * 0.05
    calls: list[int] = []

    def compute() -> MediaRows:
        calls.append(1)
        return MediaRows(rows, 0)

    return ids, MediaPrompt(tuple(runs), positions(n, runs), f"seed{seed}", compute), calls


def _reference_hidden(model, ids: np.ndarray, media: MediaPrompt) -> np.ndarray:
    lm = model.model.language_model
    with torch.no_grad():
        x = lm.embed_tokens(torch.as_tensor(ids[None].astype(np.int64)))
        at = 0
        for run in media.runs:
            x[0, run.start:run.end] = torch.from_numpy(media.embed()[at:at + run.n_tokens])
            at += run.n_tokens
        pos = torch.from_numpy(media.positions.astype(np.int64))[:, None, :]
        return lm(inputs_embeds=x, position_ids=pos, use_cache=False).last_hidden_state[0].numpy()


def test_media_runs_decode_like_the_reference(tower, tiny_hf_model):
    # Runs longer than n_batch (16) and runs across chunk borders, in the state and after it.
    runs = [Run(40, 64, 4, 6), Run(70, 71, 1, 1), Run(90, 98, 2, 4)]
    ids, media, _ = _prompt(tower, 0, runs, 140)
    hidden, cached = tower.forward(ids, 36, 70, None, media)
    assert cached == 0
    reference = _reference_hidden(tiny_hf_model, ids, media)
    scale = np.abs(reference).max()
    assert np.abs(hidden - reference).max() / scale < 2e-4  # f32 noise (the text parity bound is 1e-3)
    # Ignoring the media (their pad tokens as text) is far from it: the test can fail.
    assert np.abs(tower.forward(ids, 36, 70)[0] - reference).max() / scale > 1e-2


def test_media_states_are_reused_exactly_and_keyed_by_digest(tower):
    runs = [Run(40, 52, 3, 4)]
    ids, media, calls = _prompt(tower, 1, runs, 120)
    cache = StateCache(64 << 20)
    first, _ = tower.forward(ids, 36, 30, cache, media)
    assert len(calls) == 1 and media.cached_tokens == 0  # computed: usage.cached_media_tokens 0
    other = ids.copy()
    other[70:] = (other[70:] + 1) % 400  # another question set about the same picture
    again = MediaPrompt(media.runs, positions(len(other), runs), media.digest, media.compute)
    hidden, cached = tower.forward(other, 36, 30, cache, again)
    assert cached == 66 and len(calls) == 1  # the state restored: the vision tower did not run again
    assert again.cached_tokens == 12  # so every media token counts as cached
    assert np.array_equal(hidden, tower.forward(other, 36, 30, None, again)[0])
    # The same token ids with another picture: nothing of the first is reused.
    ids2, media2, calls2 = _prompt(tower, 2, runs, 120)
    media2 = MediaPrompt(media2.runs, media2.positions, "another", media2.compute)
    _, cached2 = tower.forward(ids, 36, 30, cache, media2)
    assert cached2 == 36 and len(calls2) == 1
    assert np.array_equal(tower.forward(ids, 36, 30, cache, media)[0], first)
