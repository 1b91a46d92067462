"""Side-by-side ratios for ``clef-gguf bench --versus``: A and B alternate within each round (ABAB,
then BABA), several rounds, and the report is the median of the per-round ratios A/B with their
spread, so a noisy machine moves both sides alike. Never a timed assertion: numbers to read.

- ``prefill``: a whole decision (plain path, no cache) vs a bare llama.cpp prefill of the same
  token ids (lm_head for the last token only, same threads, same n_batch): the physical floor.
- ``reuse``: four question sets about one state with the state cache vs four plain decisions.
- ``transformers``: a decision vs the transformers reference of the same release (backbone + head,
  fp32, the same torch threads) on the same request.
- ``packed``: several decisions with ``--pack`` prompts per llama_decode vs the same decisions one at
  a time (``Clef.run_many``, state cache off), and how far their probabilities are apart; with
  ``--synthetic``, the tower alone on prompts of exactly ``--tokens`` ids, for sizes the model's own
  template cannot make (the demo tokenizer spends ~300 tokens on the template).
"""

from __future__ import annotations

import contextlib
import ctypes
import statistics
import time
from collections.abc import Callable, Iterator

import llama_cpp as ll
import numpy as np

from clef_gguf.core.limits import SYSTEM_PREFIX_TOKENS
from clef_gguf.pipeline import answer
from clef_gguf.tower.cache import StateCache
from clef_gguf.core.errors import InvalidValue
from clef_gguf.tower.llama_tower import Tower, extra_buffer_types
from clef_gguf.runtime.stages import head_logits


class BarePrefill:
    """A plain llama.cpp context: logits for the last token of each chunk, nothing else."""

    def __init__(self, path: str, n_ctx: int, n_batch: int, threads: int):
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = extra_buffer_types()  # the same kernels as the tower's
        self.model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        cparams = ll.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, n_batch
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        self.n_batch = n_batch

    def __call__(self, ids: np.ndarray) -> None:
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        for start in range(0, len(ids), self.n_batch):
            chunk = np.ascontiguousarray(ids[start:start + self.n_batch], dtype=np.int32)
            batch = ll.llama_batch_get_one(chunk.ctypes.data_as(ctypes.POINTER(ll.llama_token)),
                                           len(chunk))
            if ll.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

    def close(self) -> None:
        ll.llama_free(self.ctx)
        ll.llama_model_free(self.model)


def alternate(a: Callable[[], object], b: Callable[[], object], rounds: int) -> dict:
    """Median A/B over ``rounds`` (order flipped every round), with min/max and medians in ms."""
    ratios, ta, tb = [], [], []
    for r in range(rounds):
        order = (("a", a), ("b", b)) if r % 2 == 0 else (("b", b), ("a", a))
        times = {}
        for name, fn in order:
            start = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - start
        ta.append(times["a"])
        tb.append(times["b"])
        ratios.append(times["a"] / times["b"])
    return {"rounds": rounds, "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
            "a_ms_median": round(statistics.median(ta) * 1e3, 2),
            "b_ms_median": round(statistics.median(tb) * 1e3, 2)}


@contextlib.contextmanager
def swapped_state_cache(clef) -> Iterator[StateCache]:
    """``clef`` with its state cache off (every decision decodes its whole prompt) inside the block, which
    may set others; its own cache restored after. Yields the empty cache."""
    saved, clef.state_cache = clef.state_cache, StateCache(0)
    try:
        yield clef.state_cache
    finally:
        clef.state_cache = saved


def decide_cold(clef, cache: StateCache, requests: list[dict]) -> None:
    """Decide each of ``requests`` with ``cache`` as the state cache, emptied first: each round starts
    cold (a state is decoded once, then restored)."""
    cache.clear()
    clef.state_cache = cache
    for r in requests:
        clef.decide(r)


def versus_prefill(clef, request: dict, rounds: int) -> dict:
    if not isinstance(clef.tower, Tower):
        raise InvalidValue("--versus prefill compares against llama.cpp: it needs a GGUF tower", field="backend")
    ids = clef.prepare(request).encoded.ids
    bare = BarePrefill(clef.files.tower, clef.tower.n_ctx, clef.tower.n_batch,
                       clef.tower.threads)
    try:
        bare(ids)  # warm-up both: page in the mmap
        with swapped_state_cache(clef):
            clef.decide(request)
            result = alternate(lambda: clef.decide(request), lambda: bare(ids), rounds)
    finally:
        bare.close()
    return {"versus": "prefill", "tokens": int(len(ids)),
            "a": "clef-gguf decide (no cache)", "b": "bare llama.cpp prefill", **result}


def versus_reuse(clef, state: str, question_sets: list[dict], rounds: int) -> dict:
    requests = [{"state": state, "questions": q} for q in question_sets]
    cached = StateCache(clef.state_cache.max_bytes or StateCache().max_bytes)
    with swapped_state_cache(clef) as plain:
        decide_cold(clef, plain, requests)  # warm-up
        result = alternate(lambda: decide_cold(clef, cached, requests),
                           lambda: decide_cold(clef, plain, requests), rounds)
    tokens = clef.prepare(requests[0]).encoded.state_tokens
    return {"versus": "reuse", "state_tokens": tokens, "question_sets": len(requests),
            "a": f"{len(requests)} question sets, state cache",
            "b": f"{len(requests)} plain decisions", **result}


def versus_transformers(clef, request: dict, release: str, rounds: int) -> dict:
    from clef_gguf.tools.parity import Reference

    reference = Reference(release)  # loads with torch's threads: set to the tower's by Clef.load
    with swapped_state_cache(clef):
        reference.probabilities(request)  # warm-up both
        clef.decide(request)
        result = alternate(lambda: clef.decide(request),
                           lambda: reference.probabilities(request), rounds)
    return {"versus": "transformers", "tokens": int(clef.prepare(request).encoded.n_tokens),
            "a": "clef-gguf decide (no cache)", "b": "transformers backbone + head, fp32", **result}



SYNTHETIC_PREFIX = SYSTEM_PREFIX_TOKENS  # the synthetic prompts' prefix is as long as the release's


def _agreement(clef, prepared: list, pack: int) -> dict:
    """max |dh| and max |dp| between the packed and the one-by-one hidden states of ``prepared``."""
    prompts = [(p.encoded.ids, p.encoded.prefix_tokens, p.encoded.state_tokens) for p in prepared]
    packed = clef.tower.forward_many(prompts, None, pack=pack)
    dh, dp = [], []
    for p, prompt, got in zip(prepared, prompts, packed):
        ref = clef.tower.forward(*prompt, None)[0]
        dh.append(float(np.abs(got[0] - ref).max()))
        a, b = (head_logits(clef.head, clef.lexical, p.encoded, h)[0] for h in (got[0], ref))
        pa, pb = (answer.split_probabilities(x, p.encoded.option_counts) for x in (a, b))
        dp.append(max(float(np.abs(x - y).max()) for x, y in zip(pa, pb)))
    return {"max_abs_dh": max(dh, default=0.0), "max_abs_dp": max(dp, default=0.0)}


def versus_packed(clef, requests: list[dict], pack: int, rounds: int) -> dict:
    prepared = [clef.prepare(r) for r in requests]
    with swapped_state_cache(clef):  # every round decodes every prompt
        clef.run_many(prepared, pack=pack)  # warm-up both; makes the packed context
        clef.run_many(prepared, pack=1)
        clef.tower.pack_stats.clear()
        result = alternate(lambda: clef.run_many(prepared, pack=pack),
                           lambda: clef.run_many(prepared, pack=1), rounds)
        decodes = {str(k): v // rounds for k, v in sorted(clef.tower.pack_stats.items())}
        result |= _agreement(clef, prepared, pack)
    tokens = [p.encoded.n_tokens for p in prepared]
    return {"versus": "packed", "pack": pack, "requests": len(requests),
            "tokens": [min(tokens), max(tokens)],
            "a": f"{len(requests)} decisions, {pack} prompts per llama_decode",
            "b": f"{len(requests)} decisions one at a time",
            "packed_decodes_per_round": decodes, **result}


def versus_packed_tower(clef, tokens: int, n: int, pack: int, rounds: int) -> dict:
    """The tower alone: ``n`` prompts of ``tokens`` ids (a shared prefix, distinct states, one shared
    schema half as long as the state), packed vs one at a time, no cache."""
    tower = clef.tower
    rng = np.random.default_rng(0)
    prefix = min(SYNTHETIC_PREFIX, tokens - 2)
    rest = max(1, (tokens - prefix) // 3)
    schema = rng.integers(0, tower.n_vocab, rest, dtype=np.int32)
    head = rng.integers(0, tower.n_vocab, prefix, dtype=np.int32)
    prompts = [(np.concatenate([head, rng.integers(0, tower.n_vocab, tokens - prefix - rest, dtype=np.int32),
                                schema]), prefix, tokens - prefix - rest) for _ in range(n)]
    tower.forward_many(prompts, None, pack=pack)  # warm-up both; makes the packed context
    for prompt in prompts:
        tower.forward(*prompt, None)
    tower.pack_stats.clear()
    result = alternate(lambda: tower.forward_many(prompts, None, pack=pack),
                       lambda: [tower.forward(*prompt, None) for prompt in prompts], rounds)
    decodes = {str(k): v // rounds for k, v in sorted(tower.pack_stats.items())}
    packed = tower.forward_many(prompts, None, pack=pack)
    dh = max(float(np.abs(got[0] - tower.forward(*prompt, None)[0]).max()) for got, prompt in zip(packed, prompts))
    return {"versus": "packed", "synthetic": True, "pack": pack, "requests": n, "tokens": [tokens, tokens],
            "segments": {"prefix": prefix, "state": tokens - prefix - rest, "schema": rest},
            "a": f"tower, {n} prompts, {pack} per llama_decode", "b": f"tower, {n} prompts one at a time",
            "packed_decodes_per_round": decodes, **result, "max_abs_dh": dh}
