"""The llama.cpp tower wrapper on the tiny converted model: chunking, nextn vs embeddings mode, errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from clef_gguf import errors, tower as tower_mod
from clef_gguf.files import from_directory
from clef_gguf.tower import Tower


@pytest.fixture(scope="module")
def gguf_path(tiny_model_dir):
    return from_directory(tiny_model_dir).tower


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(1).integers(0, 300, size=700).astype(np.int32)


def test_hidden_states_shape_and_determinism(gguf_path, ids):
    with Tower.load(gguf_path, n_ctx=1024, threads=2) as t:
        assert t.uses_nextn  # the staging API is bound: no lm_head over the prompt
        h1 = t.hidden_states(ids[:50])
        h2 = t.hidden_states(ids[:50])
        assert h1.shape == (50, t.n_embd) and h1.dtype == np.float32
        assert np.array_equal(h1, h2)  # memory is cleared between prompts
        assert np.isfinite(h1).all()


def test_long_prompt_is_decoded_in_chunks(gguf_path, ids):
    with Tower.load(gguf_path, n_ctx=1024, threads=2, n_batch=512) as big:
        ref = big.hidden_states(ids)
    with Tower.load(gguf_path, n_ctx=1024, threads=2, n_batch=64) as small:
        got = small.hidden_states(ids)  # 11 decode calls; state carries over
    # GDN chunking depends slightly on the ubatch size; the states must still agree closely.
    assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max()


def test_causal_prefix_is_unaffected_by_later_tokens(gguf_path, ids):
    with Tower.load(gguf_path, n_ctx=1024, threads=2) as t:
        full = t.hidden_states(ids[:100])
        head = t.hidden_states(ids[:40])
    # Not bit-identical: the GDN kernels chunk a 100-token and a 40-token batch differently.
    assert np.abs(full[:40] - head).max() <= 1e-3 * np.abs(head).max()


def test_nextn_equals_embeddings_mode(gguf_path, ids, monkeypatch):
    with Tower.load(gguf_path, n_ctx=1024, threads=2) as t:
        nextn = t.hidden_states(ids[:200])
    monkeypatch.setattr(tower_mod, "_set_nextn", None)  # force the fallback path
    with Tower.load(gguf_path, n_ctx=1024, threads=2) as t:
        assert not t.uses_nextn
        embd = t.hidden_states(ids[:200])
    assert np.array_equal(nextn, embd)


def test_bad_prompts_are_errors_not_aborts(gguf_path):
    with Tower.load(gguf_path, n_ctx=256, threads=1) as t:
        with pytest.raises(errors.InferenceError, match="does not fit"):
            t.hidden_states(np.zeros(300, dtype=np.int32))
        with pytest.raises(errors.InferenceError, match="outside the GGUF vocab"):
            t.hidden_states(np.array([1, t.n_vocab], dtype=np.int32))
        with pytest.raises(errors.InferenceError):
            t.hidden_states(np.zeros(0, dtype=np.int32))


def test_missing_file():
    with pytest.raises(errors.ModelNotFound):
        Tower.load("/nonexistent/model.gguf")


def test_corrupt_gguf_is_a_clean_error_in_a_fresh_process(gguf_path, tmp_path):
    data = gguf_path.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) * 2 // 3])
    code = ("import json,sys\nfrom clef_gguf.tower import Tower\nfrom clef_gguf.errors import ClefError\n"
            f"try:\n    Tower.load({str(bad)!r})\nexcept ClefError as e:\n"
            "    print(json.dumps(e.to_dict()))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert err["code"] == "corrupt_model" and "could not load" in err["message"]


@pytest.mark.parametrize("threads", [0, -3, 1.5])
def test_threads_must_be_positive(tiny_model_dir, threads):
    with pytest.raises(errors.InvalidValue) as info:
        tower_mod.Tower.load(tiny_model_dir / "tower-f32.gguf", threads=threads)
    assert info.value.field == "threads"
