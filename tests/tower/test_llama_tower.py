"""The llama.cpp tower wrapper on the tiny converted model: chunking, nextn vs embeddings mode, errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from clef_gguf.core import errors
from clef_gguf.tower import llama, packing
from clef_gguf.formats.files import from_directory
from clef_gguf.tower.cache import StateCache
from clef_gguf.tower.llama_tower import Tower
from clef_gguf.tower.protocol import LanguageTower


@pytest.fixture(scope="module")
def gguf_path(tiny_model_dir):
    return from_directory(tiny_model_dir).tower


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(1).integers(0, 300, size=700).astype(np.int32)


def test_hidden_states_shape_and_determinism(gguf_path, ids):
    with Tower.load(gguf_path, n_ctx=1024, threads=2) as t:
        assert t.uses_nextn  # the staging API is bound: no lm_head over the prompt
        assert isinstance(t, LanguageTower) and t.details() == {"attention": "exact-f32"}
        h1 = t.hidden_states(ids[:50])
        h2 = t.hidden_states(ids[:50])
        assert h1.shape == (50, t.n_embd) and h1.dtype == np.float32
        assert np.array_equal(h1, h2)  # memory is cleared between prompts
        assert np.isfinite(h1).all()


@pytest.mark.slow  # a prompt of several chunks, twice
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
    monkeypatch.setattr(llama, "_set_nextn", None)  # force the fallback path
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
    code = ("import json,sys\nfrom clef_gguf.tower.llama_tower import Tower\n"
            "from clef_gguf.core.errors import ClefError\n"
            f"try:\n    Tower.load({str(bad)!r})\nexcept ClefError as e:\n"
            "    print(json.dumps(e.to_dict()))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert err["code"] == "corrupt_model" and "could not load" in err["message"]


def test_the_attention_setting_follows_the_weights(gguf_path, tiny_model_dir_factory):
    """f32 weights on the CPU get the exact setting (f32 K/V, no flash attention), quantized ones
    llama.cpp's default; a load option names either; the packed context gets the single one's."""
    q8 = from_directory(tiny_model_dir_factory("q8_0")).tower
    with Tower.load(gguf_path, n_ctx=1024, threads=1) as exact, Tower.load(q8, n_ctx=1024, threads=1) as quant:
        assert exact.attention == "exact-f32" and quant.attention == "default"
        assert exact._ctx.attention == llama.ATTENTION["exact-f32"]
        assert exact._ctx.attention.kv_type == llama.ll.GGML_TYPE_F32
        assert exact._ctx.attention.flash_attn == llama.ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        # f32 K/V cells: the saved state of the same prompt is larger than llama.cpp's f16 one
        ids = np.arange(200, dtype=np.int32)
        exact.hidden_states(ids)
        quant.hidden_states(ids)
        assert exact._ctx.state_size(0) > quant._ctx.state_size(0)
        exact.forward_many([(ids, 36, 100), (ids[:150], 36, 50)], None, pack=2)
        assert exact._pool.packed is not None and exact._pool.packed[0].attention is exact._ctx.attention
    with Tower.load(gguf_path, n_ctx=256, threads=1, attention="default") as plain:
        assert plain.attention == "default" and plain.details() == {"attention": "default"}
    with pytest.raises(errors.InvalidSetting) as info:
        Tower.load(gguf_path, attention="fast")
    assert info.value.field == "attention"


def test_layer_states_leave_the_final_states_alone(gguf_path, ids):
    with Tower.load(gguf_path, n_ctx=1024, threads=2, n_batch=128) as t:
        want, _ = t.forward(ids[:400], 36, 200)
        final, layers = t.layer_states(ids[:400], 36, 200)
        assert np.array_equal(final, want)
        assert len(layers) == t._model.n_layer - 1 and all(h.shape == want.shape for h in layers)
        assert not any(np.array_equal(h, want) for h in layers)
        assert np.array_equal(t.forward(ids[:400], 36, 200)[0], want)  # staging is off again


def test_the_tower_is_composed_not_inherited():
    # a reader finds forward where the tower is; the schedule and the packed decoder are its parts
    assert Tower.__bases__ == (object,)
    assert {"forward", "forward_many", "hidden_states"} <= set(vars(Tower))


def test_a_fine_tunes_view_shares_the_tower_and_keeps_its_own_reuse(gguf_path, tiny_fine_tunes, ids):
    """``adapted`` builds a view explicitly: the loaded tower's model, context, lock and pool; its own
    adapter, cache tag, decoded prefix and pack stats. In a shared cache its states are its own."""
    prompt = (ids[:200], 36, 100)
    with Tower.load(gguf_path, n_ctx=1024, threads=2, n_batch=128) as base:
        base_h, _ = base.forward(*prompt)
        view = base.adapted(tiny_fine_tunes["a"] / "adapter-f32.gguf", tag="a")
        assert all(getattr(view, n) is getattr(base, n) for n in ("_model", "_ctx", "_lock", "_pool"))
        assert (view.cache_tag, base.cache_tag) == ("a", "") and view.adapter_path and not base.adapter_path
        assert view._schedule.prefix is None and base._schedule.prefix is not None
        assert view.pack_stats is not base.pack_stats
        cache = StateCache(64 << 20)
        h, cached = view.forward(*prompt, cache)
        assert cached == 0 and not np.array_equal(h, base_h)  # its own prefix, through its adapter
        assert base.forward(*prompt, cache)[1] == 36  # only the base's own prefix: not the view's state
        view.close()  # a view owns nothing
        assert not base.closed and np.array_equal(base.forward(*prompt)[0], base_h)


@pytest.mark.parametrize("threads", [0, -3, 1.5])
def test_threads_must_be_positive(tiny_model_dir, threads):
    with pytest.raises(errors.InvalidSetting) as info:
        Tower.load(tiny_model_dir / "tower-f32.gguf", threads=threads)
    assert info.value.field == "threads"


# ---------------------------------------------------------------- several prompts per decode
PREFIX = 36


@pytest.fixture(scope="module")
def packed_prompts(ids):
    """Mixed lengths: states of 0, < 64 and several chunks; two prompts about one state; a repeat."""
    rng = np.random.default_rng(5)
    prefix, schema = ids[:PREFIX], rng.integers(0, 300, 90).astype(np.int32)
    states = [rng.integers(0, 300, n).astype(np.int32) for n in (0, 20, 63, 64, 150, 333)]
    prompts = [(np.concatenate([prefix, s, schema]), PREFIX, len(s)) for s in states]
    prompts.append((np.concatenate([prefix, states[4], schema[:30]]), PREFIX, len(states[4])))
    prompts.append(prompts[-1])
    prompts.append((np.concatenate([prefix, states[2]]), PREFIX, len(states[2])))  # no schema at all
    return prompts


def one_by_one(path, prompts, cache_mb):
    """``forward`` for each prompt in order, on a fresh tower and cache: the reference."""
    with Tower.load(path, n_ctx=1024, threads=2, n_batch=128) as t:
        cache = StateCache(cache_mb << 20)
        return [t.forward(*p, cache) for p in prompts], cache


@pytest.mark.parametrize("cache_mb", [0, 64])
def test_forward_many_equals_one_by_one(gguf_path, packed_prompts, cache_mb):
    """Packed hidden states are the one-by-one ones bit for bit, and so are cached token counts
    and the state cache's entries, for 2, 4 and 8 sequences per decode."""
    want, want_cache = one_by_one(gguf_path, packed_prompts, cache_mb)
    with Tower.load(gguf_path, n_ctx=1024, threads=2, n_batch=128) as t:
        for pack in (2, 4, 8):
            t._schedule.prefix = None  # as fresh as the reference
            t.pack_stats.clear()
            cache = StateCache(cache_mb << 20)
            got = t.forward_many(packed_prompts, cache, pack=pack)
            for (h, cached), (ref, ref_cached) in zip(got, want):
                assert np.array_equal(h, ref) and cached == ref_cached
            assert max(t.pack_stats) > 1  # several prompts really shared a decode
            assert set(cache._entries) == set(want_cache._entries)


def test_pack_one_is_forward(gguf_path, packed_prompts):
    want, _ = one_by_one(gguf_path, packed_prompts, 64)
    with Tower.load(gguf_path, n_ctx=1024, threads=2, n_batch=128) as t:
        got = t.forward_many(packed_prompts, StateCache(64 << 20), pack=1)
        assert not t.pack_stats  # no packed context at all
        assert all(np.array_equal(h, ref) and c == rc for (h, c), (ref, rc) in zip(got, want))
        with pytest.raises(errors.InvalidValue):
            t.forward_many(packed_prompts, pack=0)


def test_an_error_stays_with_its_prompt(gguf_path, packed_prompts):
    bad = [(np.array([1, 10**6], dtype=np.int32), 0, 0), (np.zeros(2000, dtype=np.int32), PREFIX, 0)]
    prompts = [packed_prompts[1], bad[0], packed_prompts[4], bad[1], packed_prompts[5]]
    want, _ = one_by_one(gguf_path, [packed_prompts[i] for i in (1, 4, 5)], 0)
    with Tower.load(gguf_path, n_ctx=1024, threads=2, n_batch=128) as t:
        got = t.forward_many(prompts, None, pack=4)
    assert isinstance(got[1], errors.InferenceError) and "outside the GGUF vocab" in got[1].message
    assert isinstance(got[3], errors.InferenceError) and "does not fit" in got[3].message
    assert all(np.array_equal(g[0], w[0]) for g, w in zip([got[0], got[2], got[4]], want))


def test_a_failed_packed_decode_falls_back_to_one_by_one(gguf_path, packed_prompts, monkeypatch):
    want, _ = one_by_one(gguf_path, packed_prompts, 0)
    calls = []

    def failing(self, group):
        calls.append(len(group))
        raise errors.InferenceError("llama_decode failed with code -3")

    monkeypatch.setattr(llama.LlamaBatch, "fill", failing)
    with Tower.load(gguf_path, n_ctx=1024, threads=2, n_batch=128) as t:
        got = t.forward_many(packed_prompts, None, pack=4)
    assert calls  # the packed path ran, failed, and every prompt was decoded alone
    assert all(np.array_equal(h, ref[0]) for (h, _), ref in zip(got, want))


@pytest.mark.parametrize("attention", ["exact-f32", "default"])
def test_packed_and_single_paths_share_the_state_cache(gguf_path, packed_prompts, attention):
    """A state decoded packed restores in ``forward`` and the other way round, with the answers of
    a fresh decode: the packed context's state layout is converted, not a second kind of entry.
    Under either attention setting: a saved state carries its V layout and K/V type."""
    prefix, state = packed_prompts[5][0][:PREFIX + 333], packed_prompts[4][0][:PREFIX + 150]
    tail = np.arange(40, 80, dtype=np.int32)
    later = [(np.concatenate([prefix, tail]), PREFIX, 333), (np.concatenate([state, tail]), PREFIX, 150)]
    with Tower.load(gguf_path, n_ctx=1024, threads=2, n_batch=128, attention=attention) as t:
        fresh = [t.forward(*p, None)[0] for p in later]
        cache = StateCache(64 << 20)
        t.forward_many(packed_prompts[4:6], cache, pack=2)  # both states decoded packed
        h, cached = t.forward(*later[0], cache)
        assert cached == PREFIX + 333 and np.array_equal(h, fresh[0])
        cache = StateCache(64 << 20)
        t.forward(*packed_prompts[4], cache)  # decoded one by one, restored packed
        (h, cached), _ = t.forward_many([later[1], packed_prompts[5]], cache, pack=2)
        assert cached == PREFIX + 150 and np.array_equal(h, fresh[1])


def test_packing_policy(gguf_path, packed_prompts, monkeypatch):
    """The policy's choice: CPU packs prompts up to its max_tokens, longer ones run alone; a GPU
    tower packs more per call; a packed context that does not fit memory is not made."""
    cpu, gpu = packing.PACKING["cpu"], packing.PACKING["gpu"]
    with Tower.load(gguf_path, n_ctx=cpu.max_tokens + 256, threads=2, n_batch=128) as t:
        assert t.pack_rule is cpu and t.pack_size(cpu.max_tokens) == cpu.pack > 1
        assert t.pack_size(cpu.max_tokens + 1) == 1
        long = (np.resize(packed_prompts[5][0], cpu.max_tokens + 1), PREFIX, cpu.max_tokens + 1 - PREFIX)
        t.forward_many([long, long], None)  # too long for the policy: never packed
        assert not t.pack_stats
        t.forward_many(packed_prompts, None)
        assert 1 < max(t.pack_stats) <= cpu.pack
        monkeypatch.setattr(Tower, "gpu_layers", property(lambda self: -1))
        assert t.pack_rule is gpu and t.pack_size(10) == gpu.pack == 16
    monkeypatch.undo()
    with Tower.load(gguf_path, n_ctx=1024, threads=2, n_batch=128) as t:
        monkeypatch.setattr(t._pool, "free_memory", lambda offloaded: 0)  # no room for a packed context
        want = [t.forward(*p, None)[0] for p in packed_prompts]
        got = t.forward_many(packed_prompts, None, pack=4)
        assert not t.pack_stats and all(np.array_equal(g[0], w) for g, w in zip(got, want))


def test_a_chunk_flags_no_output_row_and_its_states_are_those_of_batch_get_one(tiny_model_dir, monkeypatch):
    """llama_batch_get_one made each chunk's last token an output, so the lm_head ran once per chunk for a
    row nothing reads; the text path now decodes with every position given and no output flagged. The
    hidden states are the same bytes."""
    ids = np.random.default_rng(3).integers(300, 600, size=300).astype(np.int32)
    flags: list[np.ndarray] = []
    decode = llama.LlamaContext.decode

    def spy(self, batch):
        flags.append(np.ctypeslib.as_array(batch.logits, shape=(batch.n_tokens,)).copy())
        return decode(self, batch)

    with Tower.load(from_directory(tiny_model_dir).tower, n_ctx=1024, n_batch=128) as tower:
        monkeypatch.setattr(llama.LlamaContext, "decode", spy)
        now = tower.hidden_states(ids)
        assert [len(f) for f in flags] == [128, 128, 44] and not any(f.any() for f in flags)  # no output row
        monkeypatch.undo()
        ctx = tower._ctx
        ctx.clear()
        before = []
        for start, stop in ((0, 128), (128, 256), (256, 300)):  # the old way: llama_batch_get_one
            ctx.decode_tokens(np.ascontiguousarray(ids[start:stop]))
            before.append(ctx.rows(stop - start, tower.n_embd))
        assert np.array_equal(now, np.concatenate(before))
