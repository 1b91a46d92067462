"""Evidence from the head's attention: the state's rendered text and its JSON paths
(:func:`state_layout`), each state token's characters (:func:`state_offsets`), and one option's
attention over the prompt turned into shares of the prompt's parts and ranked spans of the state.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from clef_gguf.core import errors
from clef_gguf.core.questions import winner
from clef_gguf.pipeline.encode import Encoded, Encoder, bounded_encoding, render

# A word, or a run of punctuation: the units that spans are merged from.
UNIT = re.compile(r"\w+|[^\w\s]+")
DIGITS = 4  # shares are rounded as the answers' probabilities are
JOIN = 0.5  # a word joins a neighbouring seed's span with at least this part of the seed's weight
STANDS_OUT = 1.5  # ... and this many times a word's mean weight: evenly spread attention widens nothing


# ---------------------------------------------------------------- the state as text
@dataclass(frozen=True)
class StateLayout:
    """The state's rendered text (what the prompt holds) and, for a JSON state, every member's and
    element's character range with its JSONPath (deepest last among nested ones)."""

    text: str
    nodes: tuple[tuple[int, int, str], ...] = ()

    def path(self, start: int, end: int) -> str | None:
        """The JSONPath of the deepest member or element holding ``[start, end)`` (None: not JSON, or
        the span crosses members of the top level)."""
        best = None
        for a, b, path in self.nodes:
            if a <= start and end <= b and (best is None or b - a <= best[1] - best[0]):
                best = (a, b, path)
        return None if best is None else best[2]


def state_layout(state: Any) -> StateLayout:
    text = render(state)
    if isinstance(state, str):
        return StateLayout(text)
    nodes: list[tuple[int, int, str]] = []
    pieces: list[str] = []
    _lay(state, "$", pieces, nodes, 0)
    # The walk writes what json.dumps writes; should they ever differ, spans keep no paths.
    return StateLayout(text, tuple(nodes) if "".join(pieces) == text else ())


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _lay(value: Any, path: str, out: list[str], nodes: list[tuple[int, int, str]], at: int) -> int:
    """Append ``value``'s compact sorted-key JSON to ``out``, record its members' ranges, return the
    position after it."""
    if isinstance(value, dict):
        out.append("{")
        at += 1
        for i, key in enumerate(sorted(value)):
            if i:
                out.append(",")
                at += 1
            start = at
            name = _dump(str(key))
            out.append(name + ":")
            at = _lay(value[key], "", out, nodes, at + len(name) + 1)
            member = f"{path}.{key}" if re.fullmatch(r"[A-Za-z_]\w*", str(key)) else f"{path}[{name}]"
            nodes.append((start, at, member))
            _reroot(nodes, start, at, member)
        out.append("}")
        return at + 1
    if isinstance(value, list):
        out.append("[")
        at += 1
        for i, item in enumerate(value):
            if i:
                out.append(",")
                at += 1
            start = at
            at = _lay(item, "", out, nodes, at)
            nodes.append((start, at, f"{path}[{i}]"))
            _reroot(nodes, start, at, f"{path}[{i}]")
        out.append("]")
        return at + 1
    text = _dump(value)
    out.append(text)
    return at + len(text)


def _reroot(nodes: list[tuple[int, int, str]], start: int, end: int, root: str) -> None:
    """Children were laid out before their parent's path was known: prefix theirs with it."""
    for i in range(len(nodes) - 1):
        a, b, path = nodes[i]
        if start <= a and b <= end and not path.startswith("$"):
            nodes[i] = (a, b, root + path)


def state_offsets(encoder: Encoder, text: str, ids: np.ndarray) -> list[tuple[int, int]]:
    """The character range of each of ``ids`` (the state tokens the prompt kept, the first of the
    text's own), tokenizing a bounded prefix of a long text as ``Encoder.state_ids`` does."""
    n = len(ids)
    encoding, _ = bounded_encoding(encoder.tokenizer, text, n)
    if list(encoding.ids[:n]) != [int(i) for i in ids]:
        raise errors.InternalError("the state's tokens differ from the prompt's; no evidence can be placed",
                                   field="evidence")
    return [(int(a), int(b)) for a, b in encoding.offsets[:n]]


# ---------------------------------------------------------------- attention -> spans
@dataclass(frozen=True)
class Regions:
    """Where the parts of one prompt are, in tokens."""

    pictures: tuple[int, int]
    state: tuple[int, int]
    questions: tuple[tuple[int, int], ...]
    options: tuple[tuple[int, int], ...]
    runs: tuple[tuple[int, int, int, int], ...]  # each picture: start, end, rows, cols

    @classmethod
    def of(cls, enc: Encoded) -> Regions:
        p = enc.prefix_tokens
        runs = () if enc.media is None else tuple((r.start, r.end, r.rows, r.cols) for r in enc.media.runs)
        media = (p, p + enc.media_tokens)
        return cls(media, (media[1], p + enc.state_tokens), enc.question_spans, enc.option_spans, runs)


def shares(weights: np.ndarray, regions: Regions) -> dict[str, float]:
    """How one option's attention (summing to 1 over the prompt) split between the parts."""
    def mass(spans: Sequence[tuple[int, int]]) -> float:
        return float(sum(weights[a:b].sum(dtype=np.float64) for a, b in spans))

    out = {"state": mass([regions.state])}
    if regions.runs:
        out["pictures"] = mass([regions.pictures])
    out["instructions"] = mass(regions.questions)
    out["options"] = mass(regions.options)
    out["template"] = max(0.0, float(weights.sum(dtype=np.float64)) - sum(out.values()))
    return {k: round(v, DIGITS) for k, v in out.items()}


def pictures(weights: np.ndarray, regions: Regions, grid: bool) -> list[dict[str, Any]]:
    """Each picture's share of the attention (and its patch grid's, row by row, on request)."""
    out = []
    for start, end, rows, cols in regions.runs:
        item: dict[str, Any] = {"share": round(float(weights[start:end].sum(dtype=np.float64)), DIGITS),
                                "rows": rows, "cols": cols}
        if grid:
            item["grid"] = [[round(float(x), DIGITS) for x in row]
                            for row in weights[start:end].reshape(rows, cols)]
        out.append(item)
    return out


@dataclass(frozen=True)
class CharacterMap:
    """Which characters each state token's weight is spread over, worked out once per request: each
    (non-space character, token) pair with the token's part per character, and the words (or
    punctuation runs) of the characters the kept tokens cover."""

    chars: np.ndarray  # int64: a non-space character of a token
    tokens: np.ndarray  # int64: that token
    parts: np.ndarray  # float64: 1 / that token's non-space characters
    starts: np.ndarray  # int64: each word's first character
    ends: np.ndarray  # int64: each word's end (exclusive)
    length: int

    @classmethod
    def of(cls, offsets: Sequence[tuple[int, int]], text: str) -> CharacterMap:
        bounds = np.array(offsets, dtype=np.int64).reshape(-1, 2).clip(0, len(text))
        lengths = np.maximum(bounds[:, 1] - bounds[:, 0], 0)
        tokens = np.repeat(np.arange(len(bounds)), lengths)
        first = np.repeat(np.cumsum(lengths) - lengths, lengths)
        chars = np.repeat(bounds[:, 0], lengths) + np.arange(int(lengths.sum())) - first
        space = np.array([c.isspace() for c in text] + [True], dtype=bool)
        keep = ~space[chars]
        chars, tokens = chars[keep], tokens[keep]
        counts = np.bincount(tokens, minlength=len(bounds))
        units = [(m.start(), m.end()) for m in UNIT.finditer(text, 0, _covered(offsets, len(text)))]
        starts, ends = (np.array(side, dtype=np.int64) for side in zip(*units)) if units else (
            np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        return cls(chars, tokens, 1.0 / counts[tokens], starts, ends, len(text))


def spans(weights: np.ndarray, regions: Regions, characters: CharacterMap, layout: StateLayout,
          top: int) -> list[dict[str, Any]]:
    """The ``top`` state spans with the most attention, best first: each token's weight spread over
    its non-space characters, summed per word (or punctuation run); the best words taken in order as
    seeds (none beside a span), each widened over neighbours at least ``JOIN`` as strong (and
    ``STANDS_OUT`` x the mean), touching spans merged, until ``top`` spans. ``share``: the span's part
    of the attention on the state."""
    text = layout.text
    start = regions.state[0]
    state = weights[start:regions.state[1]].astype(np.float64)
    total = float(state.sum())
    per_char = np.bincount(characters.chars, weights=state[characters.tokens] * characters.parts,
                           minlength=characters.length + 1)
    cumulative = np.concatenate([[0.0], np.cumsum(per_char)])
    units = list(zip(characters.starts.tolist(), characters.ends.tolist()))
    mass = cumulative[characters.ends] - cumulative[characters.starts]
    chosen: set[int] = set()
    floor = STANDS_OUT * float(mass.mean()) if len(units) else 0.0
    for index in (int(i) for i in np.argsort(-mass, kind="stable")):
        if index in chosen or index - 1 in chosen or index + 1 in chosen:
            continue  # a neighbour too weak to have joined a span is not one of its own either
        if _runs(chosen) >= top:
            break
        chosen.add(index)
        # A seed widens over neighbours about as strong as itself; weak glue (a comma, a filler word)
        # stops it, so spans stay phrases instead of merging into one.
        for step in (-1, 1):
            j = index + step
            while 0 <= j < len(units) and j not in chosen and mass[j] >= max(JOIN * mass[index], floor):
                chosen.add(j)
                j += step
    merged: list[tuple[int, int, float]] = []
    for index in sorted(chosen):
        a, b = units[index]
        if merged and index - 1 in chosen and merged[-1][1] == units[index - 1][1]:
            merged[-1] = (merged[-1][0], b, merged[-1][2] + float(mass[index]))
        else:
            merged.append((a, b, float(mass[index])))
    merged.sort(key=lambda s: -s[2])
    out = []
    for a, b, m in merged[:top]:
        item: dict[str, Any] = {"start": a, "end": b, "text": text[a:b],
                                "share": round(m / total, DIGITS) if total > 0 else 0.0}
        path = layout.path(a, b)
        if path is not None:
            item["path"] = path
        out.append(item)
    return out


def _covered(offsets: Sequence[tuple[int, int]], length: int) -> int:
    """Where the kept tokens end in the text (a truncated state keeps its first characters only)."""
    return min(length, max((b for _, b in offsets), default=0))


def _runs(chosen: set[int]) -> int:
    return sum(1 for i in chosen if i - 1 not in chosen)


def chosen_options(question_options: Sequence[Sequence[str]], report_orders: Sequence[Sequence[str]],
                   probs: Sequence[np.ndarray]) -> list[int]:
    """Each question's answered option, as an index in its prompt order (``winner`` over the order answers
    report them, as the answer does)."""
    out = []
    for ids, order, p in zip(question_options, report_orders, probs):
        by_id = dict(zip(ids, p))
        best = order[winner([by_id[key] for key in order])]
        out.append(list(ids).index(best))
    return out
