"""``pipeline.evidence_spans`` on hand-made weights: the rendered JSON state and its paths, words merged
into spans, shares of the prompt's parts; and ``pipeline.evidence``'s reading of the key."""

from __future__ import annotations

import re

import numpy as np
import pytest

from clef_gguf.core import errors
from clef_gguf.pipeline.encode import render
from clef_gguf.pipeline.evidence import DEFAULT_TOP, EvidenceSpec, parse_evidence
from clef_gguf.pipeline.evidence_spans import CharacterMap, Regions, chosen_options, shares, spans, state_layout

NESTED = {"b": [1, {"x y": None, "z": "deep"}], "a": "top", "é": 2.5, "t": True}


def test_the_layout_renders_what_the_prompt_holds_with_a_path_per_member():
    layout = state_layout(NESTED)
    assert layout.text == render(NESTED)
    where = {path: layout.text[a:b] for a, b, path in layout.nodes}
    assert where["$.a"] == '"a":"top"' and where["$.b[0]"] == "1"
    assert where['$.b[1]["x y"]'] == '"x y":null' and where["$.b[1].z"] == '"z":"deep"'
    assert where['$["é"]'] == '"é":2.5' and where["$.t"] == '"t":true'
    deep = layout.text.index("deep")
    assert layout.path(deep, deep + 4) == "$.b[1].z"
    assert layout.path(0, len(layout.text)) is None  # the whole object: no member holds it
    assert state_layout("plain text").nodes == () and state_layout("plain text").path(0, 5) is None
    assert state_layout([1, "two"]).path(3, 8) == "$[1]"


def regions(state: tuple[int, int], total: int) -> Regions:
    return Regions((state[0], state[0]), state, ((total - 6, total - 4),), ((total - 3, total - 1),), ())


def test_words_merge_into_ranked_spans():
    text = "alpha beta gamma, delta"
    layout = state_layout(text)
    offsets = [(0, 5), (5, 10), (10, 16), (16, 17), (17, 23)]  # byte-level style: leading spaces
    weights = np.zeros(20, dtype=np.float32)
    weights[2:7] = [0.30, 0.25, 0.05, 0.01, 0.20]  # alpha, beta adjacent and strong; delta alone
    found = spans(weights, regions((2, 7), 20), CharacterMap.of(offsets, text), layout, top=2)
    assert [s["text"] for s in found] == ["alpha beta", "delta"]
    assert found[0]["start"] == 0 and found[0]["end"] == 10
    assert found[0]["share"] == pytest.approx(0.55 / 0.81, abs=1e-4)
    assert all("path" not in s for s in found)
    one = spans(weights, regions((2, 7), 20), CharacterMap.of(offsets, text), layout, top=1)
    assert [s["text"] for s in one] == ["alpha beta"]


def test_a_truncated_state_has_spans_in_its_kept_part_only():
    text = "kept words here and then the cut part"
    offsets = [(0, 4), (4, 10), (10, 15)]
    weights = np.full(10, 0.1, dtype=np.float32)
    found = spans(weights, regions((1, 4), 10), CharacterMap.of(offsets, text), state_layout(text), top=5)
    assert max(s["end"] for s in found) <= 15


def test_shares_split_the_whole_prompt():
    weights = np.full(20, 0.05, dtype=np.float32)
    out = shares(weights, regions((2, 7), 20))
    assert out == {"state": 0.25, "instructions": 0.1, "options": 0.1, "template": 0.55}


def test_the_chosen_option_follows_the_answers_tie_rule():
    # prompt order sorted, report order as sent: a tie goes to the first in report order
    assert chosen_options([["a", "b"]], [["b", "a"]], [np.array([0.5, 0.5])]) == [1]
    assert chosen_options([["true", "false"]], [["true", "false"]], [np.array([0.2, 0.8])]) == [1]


def test_the_key():
    assert parse_evidence(None) is None and parse_evidence(False) is None
    assert parse_evidence(True) == EvidenceSpec(DEFAULT_TOP, "attention", False, False)
    assert parse_evidence({"top": 5, "mode": "occlusion", "options": True, "grid": True}) == \
        EvidenceSpec(5, "occlusion", True, True)
    with pytest.raises(errors.InvalidValue) as refused:
        parse_evidence([True])
    assert refused.value.field == "evidence" and "list" in str(refused.value)


def test_evenly_spread_attention_gives_separate_words_not_one_span():
    text = "one two three four five six seven eight"
    offsets = [(m.start(), m.end()) for m in re.finditer(r"\w+", text)]
    weights = np.full(10, 0.1, dtype=np.float32)
    weights[4] = 0.12  # "four" (the state starts at token 1) a little above the rest
    found = spans(weights, regions((1, 9), 10), CharacterMap.of(offsets, text), state_layout(text), top=3)
    assert len(found) == 3 and found[0]["text"] == "four"
    assert all(" " not in s["text"] for s in found)
    starts = sorted(s["start"] for s in found)
    assert all(text[a - 1] == " " for a in starts if a)  # whole words, none touching another span
