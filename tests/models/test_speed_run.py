"""The probe's timing schedule (``speed_run._time_tower``): which prefill lengths it times for a cheap, an
ordinary, a slow and a very slow type, on a stand-in tower whose forward sleeps a set time per token past
the system prefix; each timed prefill is a decision's forward: the prefix (at most ``PREFIX`` tokens of the
runtime's) kept, [state][rest] decoded."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest

from clef_gguf.models import speed_run
from clef_gguf.tower import llama_tower


class SleepyTower:
    def __init__(self, per_token: float, prefix: int):
        self.per_token, self.prefix, self.calls = per_token, prefix, []

    def forward(self, ids, prefix, state, cache):
        n = len(ids) - prefix  # the decision's own length (464 or 40 here): state and rest apart
        assert prefix == self.prefix and state == (n // 2 if n in (464, 40) else 0) and cache is None
        self.calls.append(len(ids) - prefix)
        time.sleep(self.per_token * (len(ids) - prefix))


@pytest.fixture
def tower(monkeypatch):
    """Scaled-down thresholds (the schedule, not the seconds, is under test); returns a tower factory."""
    monkeypatch.setattr(speed_run, "CHEAP_S", 0.02)
    monkeypatch.setattr(speed_run, "SLOW_S", 0.05)
    made = []

    def make(per_token: float, prefix: int = speed_run.PREFIX) -> SleepyTower:
        made.append(SleepyTower(per_token, prefix))

        @contextmanager
        def load(path, **kw):
            yield made[-1]
        monkeypatch.setattr(llama_tower.Tower, "load", staticmethod(load))
        return made[-1]
    return make


def test_a_cheap_decision_is_timed_at_its_own_length_three_times(tower):
    t = tower(0.00002)  # 464 tokens: ~9 ms, under CHEAP_S
    n, runs = speed_run._time_tower("probe.gguf", 464, 1, 0, 36)
    assert n == 464 and len(runs) == speed_run.CHEAP_RUNS == 3
    assert t.calls == [4, 16, 464, 464, 464, 464]  # warm-up, sizing, the full length's own warm-up, 3 runs


def test_an_ordinary_type_is_timed_at_probe_tokens(tower):
    t = tower(0.0001)  # 464 tokens: 46 ms > CHEAP_S; 128 tokens: 13 ms < SLOW_S
    n, runs = speed_run._time_tower("probe.gguf", 464, 1, 0, 36)
    assert n == speed_run.PROBE_TOKENS and len(runs) == speed_run.RUNS == 2
    assert t.calls == [4, 16, 128, 128] and min(runs) >= 0.0128


def test_a_slow_type_is_timed_at_slow_tokens_and_a_very_slow_one_on_its_sizing_run(tower):
    t = tower(0.001)  # 128 tokens: 128 ms > SLOW_S; the 16-token run, 16 ms, is not
    assert speed_run._time_tower("probe.gguf", 464, 1, 0, 36)[0] == speed_run.SLOW_TOKENS
    assert t.calls == [4, 16, 64, 64]
    t = tower(0.004)  # the 16-token run alone takes 64 ms > SLOW_S: it is the measurement
    n, runs = speed_run._time_tower("probe.gguf", 464, 1, 0, 36)
    assert (n, len(runs), t.calls) == (16, 1, [4, 16]) and runs[0] >= 0.064


def test_a_decision_shorter_than_the_timed_lengths_is_timed_at_its_own(tower):
    t = tower(0.001)
    n, _ = speed_run._time_tower("probe.gguf", 40, 1, 0, 36)  # 40 ms > CHEAP_S: the slow tier, cut to 40
    assert n == 40 and t.calls == [4, 16, 40, 40]


def test_the_probe_keeps_a_short_prefix_of_the_runtimes(tower):
    """The runtime's 36-token prefix is decoded as PREFIX tokens (the rest's time does not depend on it);
    a shorter one (a decision of fewer tokens than the prefix) as it is."""
    assert speed_run.PREFIX < 36
    tower(0.0001)
    speed_run._time_tower("probe.gguf", 464, 1, 0, 36)  # the stand-in asserts prefix == PREFIX
    t = tower(0.0001, prefix=2)
    speed_run._time_tower("probe.gguf", 464, 1, 0, 2)
    assert t.calls == [4, 16, 128, 128]
