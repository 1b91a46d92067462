"""Several prompts per ``llama_decode``: when to pack, and the sequence-state layouts it converts.

The policy (:data:`PACKING`) is data, one rule per kind of device. A packed context keeps each
sequence in a KV stream of its own, so a sequence state saved there has another layout than the
single context's: :func:`to_streams` and :func:`to_one_stream` convert between the two, so the state
cache holds one kind of entry for both paths. :func:`next_group` picks which sequences share the
next decode so that each sees the ubatches of its one-by-one schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from clef_gguf.core.errors import InferenceError


@dataclass(frozen=True)
class PackRule:
    """Whether ``Tower.forward_many`` decodes several prompts per ``llama_decode`` on one kind of device."""

    pack: int  # prompts decoded together (sequences of the packed context); 1: one at a time
    max_tokens: int  # longer prompts run one at a time; also each packed sequence's KV window
    ubatch: int  # tokens per packed llama_decode (the packed context's n_batch = n_ubatch)
    basis: str  # where the measurements this rule rests on are kept: a page and its section


# The packing policy, in one place, each rule's measurements on the page its ``basis`` names. Packing
# spreads a decode call's fixed costs (per call, per weight read) over its prompts, so it pays most for
# short prompts. On the CPU more prompts per call stop paying once the ubatches are full, while each adds
# its sequence's memory: 4, in 1,024-token ubatches. Longer prompts than 2,048 tokens run one at a time:
# each sequence's KV window would grow with them, and the policy is unmeasured there. On a GPU a decode
# call's host cost does not grow with its size, so the card wants many prompts per call: 16, in ubatches
# that hold a 512-token chunk of each (the packed context's memory is still capped by PACK_MEMORY_SHARE
# of what the device has free).
PACKING = {
    "cpu": PackRule(4, 2048, 1024, "BENCHMARKS.md#several-prompts-per-decode"),
    "gpu": PackRule(16, 2048, 8192, "docs/gpu.md#measured-on-an-h200-before-the-head-moved-beside-the-tower"),
}
# The packed context may take this share of the memory the device policy leaves free at its creation.
PACK_MEMORY_SHARE = 0.5
# A llama.cpp sequence state starts with u32 magic, u32 source sequence, then (hybrid memory, attention
# part first) u32 n_stream, a u32 cell count per KV stream (the sequence's cells follow its own stream's
# count) and the recurrent part, which is what LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY saves after the header.
SEQ_HEADER = 8


# Bytes free for a packed context: ``free(offloaded)``, the GPU's memory when the tower is offloaded,
# else host RAM. The loader passes the device policy's (``runtime.backends.device_free_memory``).
FreeMemory: TypeAlias = Callable[[bool], int]


def host_free_memory(offloaded: bool) -> int:
    """Host RAM available now: what a tower loaded without a device policy may plan with."""
    import psutil

    return int(psutil.virtual_memory().available)


def u32(*values: int) -> np.ndarray:
    return np.array(values, dtype="<u4").view(np.uint8)


def to_streams(buf: np.ndarray, n_stream: int) -> np.ndarray:
    """A one-stream sequence state (what the single context saves) in the layout of a packed context of
    ``n_stream`` KV streams: the empty streams first, the cells after the last count (llama.cpp reads
    them into the destination sequence's stream, whichever count they follow)."""
    if buf.size < SEQ_HEADER + 4 or int(buf[8:12].view("<u4")[0]) != 1:
        raise InferenceError("a saved sequence state does not have the one-stream layout")
    return np.concatenate([buf[:8], u32(n_stream, *[0] * (n_stream - 1)), buf[12:]])


def to_one_stream(buf: np.ndarray, n_stream: int, seq: int, recurrent: int) -> np.ndarray:
    """Sequence ``seq``'s state saved from a packed context, in the one-stream layout the single context
    saves (byte for byte), so that the state cache holds one kind of entry for both paths."""
    before = slice(12, 12 + 4 * seq)
    cells = slice(before.stop, buf.size - recurrent - 4 * (n_stream - 1 - seq))
    after = slice(cells.stop, buf.size - recurrent)
    if (cells.start > cells.stop or int(buf[8:12].view("<u4")[0]) != n_stream
            or buf[before].any() or buf[after].any()):
        raise InferenceError("a packed sequence state does not have the expected layout")
    return np.concatenate([buf[:4], u32(0, 1), buf[cells], buf[buf.size - recurrent:]])


def chunks(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """A segment's canonical chunks: at most ``step`` tokens each, from the segment's own start."""
    return [(s, min(s + step, end)) for s in range(start, end, step)]


@dataclass(eq=False)
class Slot:
    """One prompt of a packed wave: its sequence, what is left to decode, what it has so far."""

    index: int  # position in forward_many's input
    ids: np.ndarray
    source: np.ndarray  # the packed-layout state restored into its sequence first
    parts: list[np.ndarray]  # hidden states so far (restored, then decoded chunks)
    cached: int
    chunks: list[tuple[int, int]] = field(default_factory=list)
    save_at: int = 0  # after this token, the [prefix][state] snapshot goes to the cache (0: none)
    state_key: bytes | None = None
    seq: int = 0


def next_group(slots: list[Slot], ubatch: int) -> list[Slot]:
    """The sequences the next llama_decode advances: whole next chunks of one length, on consecutive
    sequence ids. llama.cpp's split_equal then makes one ubatch of exactly those chunks (it would cut
    unequal ones, or sequences with a gap between their ids, into other ubatches), so every sequence
    sees the ubatches of its one-by-one schedule. The slots with most chunks left go first, so that
    the prompts reach their last chunks (often the same question schema) together."""
    best: list[Slot] = []
    best_score: tuple[int, int] | None = None
    run: list[Slot] = []
    for slot in [*[s for s in slots if s.chunks], None]:
        if (slot is not None and run and slot.seq == run[-1].seq + 1
                and _length(slot) == _length(run[0])):
            run.append(slot)
            continue
        if run:
            group = run[:max(1, ubatch // _length(run[0]))]
            score = (max(len(s.chunks) for s in group), _length(run[0]) * len(group))
            if best_score is None or score > best_score:
                best, best_score = group, score
        run = [slot] if slot is not None else []
    return best


def _length(slot: Slot) -> int:
    start, end = slot.chunks[0]
    return end - start
