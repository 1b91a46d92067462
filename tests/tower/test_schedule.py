"""Prefix and state reuse: restored segments are bit-identical to decoded ones, so the cache can
never change an answer; the store stays under its byte budget."""

import threading
from dataclasses import dataclass

import numpy as np
import pytest

from clef_gguf import Clef
from clef_gguf.core import errors
from clef_gguf.tower.cache import Snapshot, StateCache
from clef_gguf.tower.llama_tower import Tower
from clef_gguf.tower.schedule import Schedule

DOC = {"ticket": "Refund for order 1182 not received after 14 days; customer is upset.",
       "history": ["asked twice", "no reply"], "amount": 129.5}
QUESTION_SETS = [
    {"urgent": {"type": "noul", "instructions": "Is it urgent?"}},
    {"team": {"type": "choice", "criteria": {"billing": "Payments", "tech": "Bugs"}}},
    {"anger": {"type": "score", "criteria": ["calm", "annoyed", "furious"]}},
    {"refund": {"type": "noul"}, "lang": {"type": "choice", "criteria": {"en": None, "de": None}}},
]


def without_cache_field(response: dict) -> dict:
    usage = {k: v for k, v in response["usage"].items() if k != "cached_tokens"}
    return {**response, "usage": usage}


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    # n_batch 16: every segment spans several chunks, the case where schedules could differ
    with Clef.load(tiny_model_dir) as cached, Clef.load(tiny_model_dir, state_cache_mb=0) as plain:
        for clef in (cached, plain):
            clef.tower.close()
            clef.tower = Tower.load(clef.files.tower, n_ctx=4096, threads=2, n_batch=16)
        yield cached, plain


def test_cached_and_plain_paths_give_byte_identical_answers(models):
    cached, plain = models
    prefix = len(cached.encoder.prefix)
    seen = []
    for round_ in range(2):
        for questions in QUESTION_SETS:
            body = {"state": DOC, "questions": questions}
            got, want = cached.decide(body), plain.decide(body)
            assert without_cache_field(got) == without_cache_field(want)
            seen.append(got["usage"]["cached_tokens"])
            assert want["usage"]["cached_tokens"] in (0, prefix)  # plain: the prefix only
    n = [cached.decide({"state": DOC, "questions": q})["usage"]["input_tokens"]
         for q in QUESTION_SETS]
    state = cached.prepare({"state": DOC, "questions": QUESTION_SETS[0]}).encoded.state_tokens
    # first round: prefix decoded once, then the state restored for every other question set;
    # second round: every prompt seen before, the tower not run at all
    assert seen[:4] == [0, prefix + state, prefix + state, prefix + state]
    assert seen[4:] == n


def test_a_new_state_restores_only_the_prefix(models):
    cached, _ = models
    out = cached.decide({"state": "a state never seen before", "questions": QUESTION_SETS[0]})
    assert out["usage"]["cached_tokens"] == len(cached.encoder.prefix)


def test_long_prompts_over_many_chunks_agree(models):
    cached, plain = models
    body = {"state": " ".join(f"line {i}: the parcel moved to depot {i % 7}." for i in range(60)),
            "questions": QUESTION_SETS[3]}
    assert cached.prepare(body).encoded.n_tokens > 10 * 16
    first, second = cached.decide(body), cached.decide({**body, "questions": QUESTION_SETS[1]})
    assert without_cache_field(first) == without_cache_field(plain.decide(body))
    assert without_cache_field(second) == without_cache_field(
        plain.decide({**body, "questions": QUESTION_SETS[1]}))
    assert second["usage"]["cached_tokens"] > 0


@pytest.mark.slow  # many prompts through a small budget
def test_the_cache_stays_under_its_budget(tiny_model_dir):
    with Clef.load(tiny_model_dir, state_cache_mb=0.4) as clef:  # a few entries of ~100 KB
        for i in range(30):
            clef.decide({"state": f"document number {i} " * 20, "questions": QUESTION_SETS[0]})
            assert clef.state_cache.nbytes <= clef.state_cache.max_bytes
        assert 0 < len(clef.state_cache) < 30  # some kept, the oldest evicted


def test_lru_store_evicts_oldest_and_refuses_what_cannot_fit():
    snap = lambda n: Snapshot(n, np.zeros(100, np.uint8), np.zeros((n, 25), np.float32))  # noqa: E731
    cache = StateCache(max_bytes=3 * snap(1).nbytes)
    for k in (b"a", b"b", b"c"):
        assert cache.put(k, snap(1))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"d", snap(1))
    assert cache.get(b"b") is None and cache.get(b"a") is not None and len(cache) == 3
    assert not cache.put(b"huge", snap(50)) and cache.get(b"huge") is None
    assert cache.nbytes <= cache.max_bytes
    assert StateCache(0).put(b"x", snap(1)) is False


@pytest.mark.parametrize("mb", [-1, "10", float("nan")])
def test_the_budget_must_be_a_size(tiny_model_dir, mb):
    from clef_gguf.core import errors

    with pytest.raises(errors.InvalidSetting) as info:
        Clef.load(tiny_model_dir, state_cache_mb=mb)
    assert info.value.field == "state_cache_mb"


@pytest.mark.slow  # many decisions
def test_decide_many_answers_in_order_groups_by_state_and_keeps_going(tiny_model_dir):
    other = {"ticket": "Printer on fire"}
    requests = [{"state": DOC, "questions": QUESTION_SETS[0]},
                {"state": other, "questions": QUESTION_SETS[1]},
                {"state": DOC, "questions": {"bad": {"type": "maybe"}}},
                {"state": DOC, "questions": QUESTION_SETS[2]},
                {"state": other, "questions": QUESTION_SETS[3]},
                {"state": DOC, "questions": QUESTION_SETS[3]}]
    with Clef.load(tiny_model_dir, state_cache_mb=0) as plain:
        want = []
        for r in requests:
            try:
                want.append(without_cache_field(plain.decide(r)))
            except Exception as exc:  # noqa: BLE001 - the ClefError's body is what must match
                want.append(exc.to_dict())
    with Clef.load(tiny_model_dir) as clef:
        got = list(clef.decide_many(iter(requests), window=4))
        # two states: each decoded once (window 1), then restored for the other three requests
        assert clef.state_cache.hits == 3
        assert len(clef.state_cache) == 2 + 5  # 2 states + the 5 answered prompts
    assert [without_cache_field(g) if "error" not in g else g for g in got] == want
    assert got[2]["error"]["code"] == "invalid_question_type"


# ---------------------------------------------------------------- the schedule, without llama.cpp
@dataclass(frozen=True)
class Kept:
    tokens: list[int]
    nbytes: int


class ListSequences:
    """Sequences (``schedule.Sequences``) that are lists of token ids, where the hidden state of a
    token is (token, position, tokens seen so far): what reuse must reproduce exactly."""

    vocab_name = "list vocab"
    n_ctx, n_vocab, n_embd, closed = 1000, 100, 3, False

    def __init__(self) -> None:
        self.decoded: list[tuple[int, int]] = []  # (start, end) of every segment appended

    def begin(self) -> list[int]:
        return []

    def resume(self, kept: Kept) -> list[int]:
        return list(kept.tokens)

    def append(self, seq: list[int], ids: np.ndarray, start: int, media: object = None) -> np.ndarray:
        self.decoded.append((start, start + len(ids)))
        rows = []
        for t in ids:
            seq.append(int(t))
            rows.append((int(t), len(seq) - 1, sum(seq)))
        return np.array(rows, dtype=np.float32).reshape(-1, 3)

    def kept_bytes(self, seq: list[int]) -> int:
        return 8 * len(seq)

    def keep(self, seq: list[int], size: int) -> Kept:
        return Kept(list(seq), size)


def list_schedule() -> Schedule:
    """The schedule a tower of these sequences would own."""
    return Schedule(ListSequences(), threading.Lock())


def test_the_plan_restores_what_is_known_and_decodes_the_rest():
    prefix, state = [1, 2, 3], [10, 11]
    first = np.array(prefix + state + [20, 21, 22], dtype=np.int32)
    other_questions = np.array(prefix + state + [30], dtype=np.int32)
    other_state = np.array(prefix + [12] + [20], dtype=np.int32)
    schedule, cache = list_schedule(), StateCache(1 << 20)
    runs = [(first, 2, (0, [(0, 3), (3, 5), (5, 8)])),
            (other_questions, 2, (5, [(5, 6)])),
            (other_state, 1, (3, [(3, 4), (4, 5)])),
            (first, 2, (8, []))]
    for ids, n_state, (cached, segments) in runs:
        schedule.seqs.decoded.clear()
        hidden, got = schedule.forward(ids, 3, n_state, cache)
        reference = list_schedule().forward(ids, 3, n_state, None)[0]
        assert np.array_equal(hidden, reference) and got == cached and schedule.seqs.decoded == segments
    plan = schedule.plan(np.array(prefix + [13, 14], dtype=np.int32), 3, 2, cache)
    assert plan.start is not None and plan.cached == 3 and plan.segments == [(3, 5)]
    assert plan.state_key == cache.key("state", np.array(prefix + [13, 14]))


def test_a_wave_leaves_a_state_another_prompt_decodes_to_the_cache():
    schedule, cache, claimed = list_schedule(), StateCache(1 << 20), set()
    a = np.array([1, 2, 3, 10, 11, 20], dtype=np.int32)
    b = np.array([1, 2, 3, 10, 11, 30], dtype=np.int32)
    assert schedule.joins(a, 3, 2, cache, claimed)
    assert not schedule.joins(a, 3, 2, cache, claimed)  # the same prompt: after a, from the cache
    assert not schedule.joins(b, 3, 2, cache, claimed)  # a decodes the state b would restore
    assert schedule.joins(b, 3, 2, None, claimed)  # no cache: nothing to wait for
    schedule.forward(a, 3, 2, cache)
    assert schedule.joins(b, 3, 2, cache, claimed)  # the state is cached now


def test_forward_each_keeps_errors_in_place():
    schedule = list_schedule()
    got = schedule.forward_each([(np.array([1, 2], dtype=np.int32), 1, 0),
                                 (np.array([1, 500], dtype=np.int32), 1, 0)], None)
    assert got[0][1] == 0 and isinstance(got[1], errors.InferenceError)
    assert "outside the list vocab" in got[1].message


def test_keep_points_snapshots_each_point_and_a_prompt_resumes_from_its_own():
    schedule, cache = list_schedule(), StateCache(1 << 20)
    original = np.array([1, 2, 3, 10, 11, 12, 13, 14, 20], dtype=np.int32)
    assert schedule.keep_points(original, 3, [7, 5, 3, 99], cache) == 7  # the prefix, then 3..5, 5..7
    assert schedule.seqs.decoded == [(0, 3), (3, 5), (5, 7)]
    assert schedule.keep_points(original, 3, [5, 7], cache) == 0  # all kept already
    for cut, n_state in ((5, 3), (7, 1)):  # the original up to ``cut``, then other tokens
        ids = np.concatenate([original[:cut], np.array([40, 41, 42], dtype=np.int32)])
        schedule.seqs.decoded.clear()
        hidden, cached = schedule.forward(ids, 3, cut - 3, cache)
        assert cached == cut and schedule.seqs.decoded == [(cut, cut + 3)]
        assert np.array_equal(hidden, list_schedule().forward(ids, 3, n_state, None)[0])
    assert list_schedule().keep_points(original, 3, [5], None) == 0  # nothing to keep into
