"""Random heads and made-up spans (``convert.synthetic.head``): reproducible, not trivial, laid out as
documented."""

from __future__ import annotations

import pytest
import torch

from clef_gguf.convert.synthetic.head import BENCH_COUNTS, random_head, synthetic_spans
from clef_gguf.heads import head_scalars

JUDGE = dict(hidden_size=32, width=16, routing_layers=2, layers=4, heads=2, feedforward=24)


def test_random_head_is_reproducible_and_not_trivial():
    a, b = random_head(JUDGE, seed=4), random_head(JUDGE, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.hidden_norm.weight, torch.ones(32))
    expected = {"prior_logit_scale": 1.7, "joint_logit_scale": 2.3, "residual_gate": -0.6}
    assert head_scalars(a) == pytest.approx(expected)
    assert not torch.equal(random_head(JUDGE, seed=5).memory_projection.weight, a.memory_projection.weight)


def test_synthetic_spans_lay_out_each_question_then_its_options():
    questions, options = synthetic_spans(100)
    assert len(questions) == len(BENCH_COUNTS) and len(options) == sum(BENCH_COUNTS)
    assert questions[0] == (100, 110) and options[0] == (114, 126) and options[1] == (130, 142)
    assert questions[1] == (146, 156)  # after the first question's two options
    spans = sorted(questions + options)
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))  # none overlaps the next


def test_random_head_refuses_a_bad_config_naming_the_key():
    from clef_gguf.core.errors import HeadMismatch

    with pytest.raises(HeadMismatch, match="width"):
        random_head(dict(JUDGE, width="wide"))
