"""The probe's timing schedule (``speed_run._time_tower``): which prefill lengths it times for a cheap, an
ordinary and a very slow type, on a stand-in tower whose forward sleeps a set time per call and per token
past the system prefix; each timed prefill is a decision's forward: the prefix (at most ``PREFIX`` tokens
of the runtime's) kept, [state][rest] decoded."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import pytest

from clef_gguf.pick import speed, speed_run
from clef_gguf.tower import llama_tower


class SleepyTower:
    def __init__(self, per_token: float, prefix: int, per_call: float = 0.0):
        self.per_token, self.prefix, self.per_call, self.calls = per_token, prefix, per_call, []

    def forward(self, ids, prefix, state, cache):
        n = len(ids) - prefix  # the decision's own length (464 or 40 here): state and rest apart
        assert prefix == self.prefix and state == (n // 2 if n in (464, 40) else 0) and cache is None
        self.calls.append(n)
        time.sleep(self.per_call * (2 if state else 1) + self.per_token * n)


@pytest.fixture
def tower(monkeypatch):
    """Scaled-down thresholds (the schedule, not the seconds, is under test); returns a tower factory."""
    monkeypatch.setattr(speed_run, "CHEAP_S", 0.02)
    monkeypatch.setattr(speed_run, "SLOW_S", 0.05)
    made = []

    def make(per_token: float, prefix: int = speed_run.PREFIX, per_call: float = 0.0) -> SleepyTower:
        made.append(SleepyTower(per_token, prefix, per_call))

        @contextmanager
        def load(path, **kw):
            yield made[-1]
        monkeypatch.setattr(llama_tower.Tower, "load", staticmethod(load))
        return made[-1]
    return make


def test_a_cheap_decision_is_timed_at_its_own_length_three_times(tower):
    t = tower(0.00002)  # 464 tokens: ~9 ms, under CHEAP_S
    got = speed_run._time_tower("probe.gguf", 464, 1, 0, 36)
    assert got.tokens == 464 and len(got.runs) == speed_run.CHEAP_RUNS == 3 and got.short_tokens is None
    # warm-up, the short end twice (sizing), the full length's own warm-up, 3 runs
    assert t.calls == [4, 16, 16, 464, 464, 464, 464]


def test_an_ordinary_type_is_timed_at_both_ends_of_the_line(tower):
    t = tower(0.0001)  # 464 tokens: 46 ms > CHEAP_S; 16 tokens: 1.6 ms < SLOW_S
    got = speed_run._time_tower("probe.gguf", 464, 1, 0, 36)
    assert (got.tokens, got.short_tokens) == (speed_run.PROBE_TOKENS, speed_run.SHORT) == (64, 16)
    assert len(got.runs) == speed_run.RUNS == 2 and len(got.short_runs) == 2
    assert t.calls == [4, 16, 16, 64, 64] and min(got.runs) >= 0.0064 and min(got.short_runs) >= 0.0016


def test_the_line_recovers_a_per_call_part_and_predicts_the_decision(tower, monkeypatch):
    """A tower with 50 ms per llama_decode call and 1 ms per token: a 464-token decision, decoded as
    state and rest, takes 2 x 50 + 464 x 1 = 564 ms; scaling the 64-token prefill (114 ms) linearly
    would say 827 ms."""
    monkeypatch.setattr(speed_run, "SLOW_S", 0.5)
    tower(0.001, per_call=0.050)
    got = speed_run._time_tower("probe.gguf", 464, 1, 0, 36)
    predicted = speed.tower_seconds(got.tokens, tuple(got.runs), got.short_tokens, tuple(got.short_runs), 464)
    assert predicted == pytest.approx(0.564, rel=0.1)
    assert statistics.median(got.runs) * 464 / 64 > 1.3 * predicted


def test_a_very_slow_type_is_timed_on_its_sizing_run(tower):
    t = tower(0.004)  # the 16-token run alone takes 64 ms > SLOW_S: it is the measurement
    got = speed_run._time_tower("probe.gguf", 464, 1, 0, 36)
    assert (got.tokens, len(got.runs), got.short_tokens, t.calls) == (16, 1, None, [4, 16]) and got.runs[0] >= 0.064


def test_a_decision_shorter_than_the_long_end_is_timed_at_its_own_length(tower):
    t = tower(0.001)
    got = speed_run._time_tower("probe.gguf", 40, 1, 0, 36)  # 40 ms > CHEAP_S: not cheap, cut to 40
    assert (got.tokens, got.short_tokens) == (40, None) and t.calls == [4, 16, 16, 40, 40]


def test_the_probe_keeps_a_short_prefix_of_the_runtimes(tower):
    """The runtime's 36-token prefix is decoded as PREFIX tokens (the rest's time does not depend on it);
    a shorter one (a decision of fewer tokens than the prefix) as it is."""
    assert speed_run.PREFIX < 36
    tower(0.0001)
    speed_run._time_tower("probe.gguf", 464, 1, 0, 36)  # the stand-in asserts prefix == PREFIX
    t = tower(0.0001, prefix=2)
    speed_run._time_tower("probe.gguf", 464, 1, 0, 2)
    assert t.calls == [4, 16, 16, 64, 64]
