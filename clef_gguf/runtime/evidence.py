"""The ``"evidence"`` block of a response: the head's attention as spans of the state, and, in occlusion
mode, the decision re-run with each span taken out.

One word per meaning: to *occlude* is the act (``occlude``: take each span out of the state and decide
again); *occluded* names its result (an occluded prompt: the original with one span's characters taken
out, encoded again by ``reencode``).

``explain`` is what ``stages.decision`` calls with the probabilities and the recorded attention. What the
numbers mean, and what they do not: docs/evidence.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np
import torch

from clef_gguf.heads.attention import HeadAttention
from clef_gguf.pipeline import answer, evidence_spans as spans
from clef_gguf.pipeline.encode import Encoded, Encoder, Prepared
from clef_gguf.pipeline.mediaprompt import positions
from clef_gguf.pipeline.lexical import RowStore
from clef_gguf.runtime import stages
from clef_gguf.tower.cache import StateCache
from clef_gguf.tower.protocol import LanguageTower


class Model(Protocol):
    """The parts of a ``Clef`` that evidence reads and re-runs."""

    encoder: Encoder
    tower: LanguageTower
    lexical: RowStore
    head: torch.nn.Module

    def temperatures(self, enc: Encoded) -> tuple[float, ...]: ...


def explain(model: Model, prepared: Prepared, probs: list[np.ndarray], attention: HeadAttention) -> dict[str, Any]:
    """The evidence block of ``prepared``'s response (``probs``: its probabilities, prompt order)."""
    spec, request, enc = prepared.request.evidence, prepared.request, prepared.encoded
    assert spec is not None
    layout = spans.state_layout(request.state)
    regions = spans.Regions.of(enc)
    offsets = spans.state_offsets(model.encoder, layout.text, enc.ids[regions.state[0]:regions.state[1]])
    characters = spans.CharacterMap.of(offsets, layout.text)
    owner = [q for q, count in enumerate(enc.option_counts) for _ in range(count)]
    rows = attention.option_rows(owner).numpy()
    ids = [[o.id for o in q.options] for q in request.questions]
    chosen = spans.chosen_options(ids, [q.report_order for q in request.questions], probs)
    first = np.cumsum((0,) + enc.option_counts)

    def one(row: np.ndarray) -> dict[str, Any]:
        item: dict[str, Any] = {"shares": spans.shares(row, regions),
                                "spans": spans.spans(row, regions, characters, layout, spec.top)}
        if regions.runs:
            item["pictures"] = spans.pictures(row, regions, spec.grid)
        return item

    questions: dict[str, Any] = {}
    for q, question in enumerate(request.questions):
        block = {"option": ids[q][chosen[q]], **one(rows[first[q] + chosen[q]])}
        if spec.options:
            block["options"] = {oid: one(rows[first[q] + k]) for k, oid in enumerate(ids[q])}
        questions[question.id] = block
    out: dict[str, Any] = {"mode": spec.mode, "top": spec.top, "questions": questions}
    if spec.mode == "occlusion":
        out["reruns"] = occlude(model, prepared, probs, chosen, questions, layout.text)
    return out


def occlude(model: Model, prepared: Prepared, probs: list[np.ndarray], chosen: list[int],
            questions: dict[str, Any], text: str) -> int:
    """Re-run the decision once per distinct span on its occluded prompt (the state with that span's
    characters taken out) and write each span's ``delta_p`` (the chosen option's probability after
    minus before) and, when the answer changes, ``top_option``. Returns the number of re-runs."""
    ranges = sorted({(s["start"], s["end"]) for block in questions.values() for s in _all_spans(block)})
    encoded = {r: reencode(model, prepared, text[:r[0]] + text[r[1]:]) for r in ranges}  # the occluded prompts
    original = prepared.encoded
    shared = {r: _shared_state(original, enc) for r, enc in encoded.items()}
    # The original prompt is decoded once in segments ending where each span's tokens begin, with a
    # snapshot at each: every re-run restores its own span's and decodes only the tokens after it.
    cache = StateCache()
    model.tower.keep_points(original.ids, original.prefix_tokens,
                            [original.prefix_tokens + n for n in shared.values()], cache, original.media)
    after = {r: rerun(model, enc, shared[r], cache) for r, enc in encoded.items()}
    for q, (qid, block) in enumerate(questions.items()):
        order = prepared.request.questions[q].report_order
        ids = [o.id for o in prepared.request.questions[q].options]
        for item, k in _spans_with_option(block, ids, chosen[q]):
            new = after[(item["start"], item["end"])][q]
            item["delta_p"] = round(float(new[k]) - float(probs[q][k]), spans.DIGITS)
            best = spans.chosen_options([ids], [order], [new])[0]
            if best != chosen[q]:
                item["top_option"] = ids[best]
    return len(ranges)


def _all_spans(block: dict[str, Any]) -> list[dict[str, Any]]:
    return block["spans"] + [s for option in block.get("options", {}).values() for s in option["spans"]]


def _spans_with_option(block: dict[str, Any], ids: list[str], chosen: int) -> list[tuple[dict[str, Any], int]]:
    """Every span of a question's block with the option whose probability its delta follows: the
    answered option for the answer's spans, each option for its own spans."""
    out = [(item, chosen) for item in block["spans"]]
    for oid, option in block.get("options", {}).items():
        out += [(item, ids.index(oid)) for item in option["spans"]]
    return out


def reencode(model: Model, prepared: Prepared, state: str) -> Encoded:
    """``prepared``'s prompt with ``state`` (text) as the state, the rest and the pictures as they were."""
    enc = prepared.encoded
    request = dataclasses.replace(prepared.request, state=state, evidence=None)
    media_ids = tuple(int(i) for i in enc.ids[enc.prefix_tokens:enc.prefix_tokens + enc.media_tokens])
    new: Encoded = model.encoder.encode(request, media_ids)
    if enc.media is not None:
        new = dataclasses.replace(new, media=dataclasses.replace(
            enc.media, positions=positions(new.n_tokens, enc.media.runs)))
    return new


def _shared_state(original: Encoded, rerun: Encoded) -> int:
    """How many state tokens (pictures included) ``rerun`` has as the original has them."""
    limit = min(original.state_tokens, rerun.state_tokens)
    start = original.prefix_tokens
    differ = np.flatnonzero(original.ids[start:start + limit] != rerun.ids[start:start + limit])
    return int(differ[0]) if differ.size else limit


def rerun(model: Model, enc: Encoded, shared: int, cache: StateCache) -> list[np.ndarray]:
    """The probabilities per question of an occluded prompt, decoded as ``[prefix][shared][rest]``
    (``[prefix][shared]`` restored from ``cache`` where the original's snapshot is there)."""
    hidden, _ = model.tower.forward(enc.ids, enc.prefix_tokens, shared, cache, enc.media)
    logits = stages.head_logits(model.head, model.lexical, enc, hidden)[0]
    return answer.split_probabilities(logits, enc.option_counts, model.temperatures(enc))
