"""The packing module without llama.cpp: state layouts, canonical chunks and the decode groups."""

import re
from pathlib import Path

import numpy as np
import pytest

from clef_gguf.core import errors
from clef_gguf.tower.packing import PACKING, Slot, chunks, next_group, to_one_stream, to_streams, u32


def test_state_layouts_round_trip_and_refuse_others():
    one = np.concatenate([u32(0xAF143CD8, 0, 1, 3), np.arange(40, dtype=np.uint8)])
    recurrent = 16
    four = to_streams(one, 4)
    assert four[8:12].view("<u4")[0] == 4 and four.size == one.size + 12
    assert np.array_equal(to_one_stream(four, 4, 3, recurrent), one)
    with pytest.raises(errors.InferenceError):
        to_streams(four, 2)  # not a one-stream state
    with pytest.raises(errors.InferenceError):
        to_one_stream(four, 4, 1, recurrent)  # the cells are not in stream 1


def test_chunks_start_at_the_segment():
    assert chunks(36, 200, 64) == [(36, 100), (100, 164), (164, 200)]
    assert chunks(5, 5, 64) == []


def slot(seq: int, *lengths: int) -> Slot:
    spans, at = [], 0
    for n in lengths:
        spans.append((at, at + n))
        at += n
    return Slot(seq, np.zeros(at, dtype=np.int32), np.zeros(0, dtype=np.uint8), [], 0, spans, seq=seq)


def test_groups_are_equal_chunks_on_consecutive_sequences():
    slots = [slot(0, 64, 10), slot(1, 64, 10), slot(2, 20), slot(3, 64, 10)]
    assert [s.seq for s in next_group(slots, 128)] == [0, 1]  # 3 is not next to 1
    assert [s.seq for s in next_group(slots, 64)] == [0]  # one ubatch's worth
    slots[0].chunks.clear()
    assert [s.seq for s in next_group(slots, 128)] == [1]  # 1 and 3 tie: the first
    assert next_group([slot(0)], 64) == []


def test_the_policy_is_data():
    assert PACKING["cpu"].pack > 1 and PACKING["gpu"].pack >= PACKING["cpu"].pack  # a GPU wants more per call
    # a GPU's ubatch holds a full 512-token chunk of every packed prompt
    assert PACKING["gpu"].ubatch >= PACKING["gpu"].pack * 512


def test_each_rule_names_the_page_section_its_measurements_are_on():
    root = Path(__file__).resolve().parents[2]
    for rule in PACKING.values():
        page, _, anchor = rule.basis.partition("#")
        headings = [line.lstrip("#").strip() for line in (root / page).read_text(encoding="utf-8").splitlines()
                    if line.startswith("#")]
        slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
        assert anchor in slugs, rule.basis
