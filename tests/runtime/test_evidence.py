"""``"evidence"`` through ``Clef`` on the tiny converted model: the same answers with it and the same
bytes without it, spans of a text state, of a JSON state (with paths), of a state over the window,
pictures' shares, occlusion's re-runs checked against decisions made by hand, and refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from clef_gguf import Clef
from clef_gguf.core import errors
from clef_gguf.pipeline.encode import render

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "media"))
from media_helpers import png_uri  # noqa: E402

QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Is this urgent?"},
    "team": {"type": "choice", "instructions": "Which team?",
             "criteria": {"billing": "Payments and refunds", "tech": None, "sales": "New deals"}},
    "anger": {"type": "score", "instructions": "How angry is the customer?",
              "criteria": ["calm", "annoyed", "furious"]},
}
JSON_STATE = {"ticket": "Refund not received after 14 days", "amount": 129.5, "tags": ["billing", "late"]}
TEXT_STATE = "My card was charged twice for the same order and nobody answers the phone."


@pytest.fixture(scope="module")
def clef(tiny_model_dir):
    with Clef.load(tiny_model_dir, max_length=2048, threads=2) as model:
        yield model


def request(state, **extra) -> dict:
    return {"state": state, "questions": QUESTIONS, **extra}


def chosen(answer: dict) -> str:
    if answer["type"] == "noul":
        return "true" if answer["noul"] >= 0.5 else "false"
    probabilities = answer["probabilities"]
    return max(probabilities, key=probabilities.get)


def bytes_of(response: dict) -> str:
    """The response's JSON less ``usage.cached_tokens``, which depends on what the state cache held."""
    return json.dumps({**response, "usage": {k: v for k, v in response["usage"].items() if k != "cached_tokens"}})


def test_without_evidence_the_same_bytes(clef):
    plain = bytes_of(clef.decide(request(JSON_STATE)))
    for off in (None, False):
        assert bytes_of(clef.decide(request(JSON_STATE, evidence=off))) == plain
    assert "evidence" not in plain


def test_answers_unchanged_and_the_audit_records_it(clef):
    plain = clef.decide(request(JSON_STATE))
    out = clef.decide(request(JSON_STATE, evidence=True))
    assert json.dumps(out["answers"]) == json.dumps(plain["answers"])
    assert out["usage"]["input_tokens"] == plain["usage"]["input_tokens"]
    assert out["audit"] == {**plain["audit"], "evidence": "attention"}
    assert set(out) == set(plain) | {"evidence"}
    assert out["evidence"]["mode"] == "attention" and out["evidence"]["top"] == 3
    assert "reruns" not in out["evidence"]


def test_json_state_spans_are_ranges_of_its_rendered_text_with_paths(clef):
    out = clef.decide(request(JSON_STATE, evidence={"top": 4}))
    text = render(JSON_STATE)
    for qid, block in out["evidence"]["questions"].items():
        assert block["option"] == chosen(out["answers"][qid])
        assert 1 <= len(block["spans"]) <= 4
        shares = [span["share"] for span in block["spans"]]
        assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1.0001
        for span in block["spans"]:
            assert text[span["start"]:span["end"]] == span["text"] and span["text"].strip() == span["text"]
        assert {span.get("path") for span in block["spans"]} <= {"$.ticket", "$.amount", "$.tags",
                                                                 "$.tags[0]", "$.tags[1]", None}
        assert set(block["shares"]) == {"state", "instructions", "options", "template"}
        assert abs(sum(block["shares"].values()) - 1) < 1e-3
        assert "options" not in block


def test_text_state_spans_and_every_option_on_request(clef):
    out = clef.decide(request(TEXT_STATE), evidence={"options": True, "top": 2})
    block = out["evidence"]["questions"]["team"]
    assert list(block["options"]) == ["billing", "sales", "tech"]  # the prompt's order
    for item in [block, *block["options"].values()]:
        assert len(item["spans"]) == 2
        for span in item["spans"]:
            assert TEXT_STATE[span["start"]:span["end"]] == span["text"] and "path" not in span
    assert block["spans"] == block["options"][block["option"]]["spans"]


def test_a_state_over_the_window_cut_on_request(clef, tiny_model_dir):
    long_state = " ".join(f"word{i}" for i in range(4000))
    with Clef.load(tiny_model_dir, max_length=1024, threads=2) as small:
        with pytest.raises(errors.ContextTooLarge) as refused:
            small.decide(request(long_state, evidence=True))
        assert refused.value.field == "state"
        out = small.decide(request(long_state, evidence=True, options={"truncate_state": True}))
    assert out["truncated"] is True
    kept = max(span["end"] for block in out["evidence"]["questions"].values() for span in block["spans"])
    assert kept < len(long_state) // 4  # only the kept tokens' characters
    for block in out["evidence"]["questions"].values():
        for span in block["spans"]:
            assert long_state[span["start"]:span["end"]] == span["text"]


def test_pictures_get_their_share_and_grid_and_occlusion_keeps_them(clef):
    body = request("Two pictures of the parcel.", images=[png_uri(32, 32, 1), png_uri(48, 16, 2)])
    plain = clef.decide(body)
    out = clef.decide({**body, "evidence": {"grid": True, "mode": "occlusion", "top": 1}})
    assert out["evidence"]["reruns"] >= 1
    assert json.dumps(out["answers"]) == json.dumps(plain["answers"])
    for block in out["evidence"]["questions"].values():
        assert set(block["shares"]) == {"state", "pictures", "instructions", "options", "template"}
        pictures = block["pictures"]
        assert len(pictures) == 2
        for picture in pictures:
            assert len(picture["grid"]) == picture["rows"] and len(picture["grid"][0]) == picture["cols"]
            assert abs(sum(map(sum, picture["grid"])) - picture["share"]) < 1e-2
        assert sum(p["share"] for p in pictures) <= block["shares"]["pictures"] + 1e-3
        for span in block["spans"]:
            assert "Two pictures of the parcel."[span["start"]:span["end"]] == span["text"]
    block = out["evidence"]["questions"]["urgent"]  # the re-run keeps the pictures: it equals a decision by hand
    (span,) = block["spans"]
    k = ["true", "false"].index(block["option"])
    before = clef.probabilities(body)[0][k]
    after = clef.probabilities({**body, "state": body["state"][:span["start"]] + body["state"][span["end"]:]})[0][k]
    assert span["delta_p"] == round(float(after) - float(before), 4)


def test_occlusion_reruns_equal_decisions_without_each_span(clef):
    out = clef.decide(request(JSON_STATE, evidence={"mode": "occlusion", "top": 2}))
    evidence = out["evidence"]
    text = render(JSON_STATE)
    ranges = {(s["start"], s["end"]) for block in evidence["questions"].values() for s in block["spans"]}
    assert evidence["reruns"] == len(ranges) and out["audit"]["evidence"] == "occlusion"
    for (start, end) in ranges:
        again = clef.probabilities(request(text[:start] + text[end:]))
        before = clef.probabilities(request(JSON_STATE))
        for q, (qid, block) in enumerate(evidence["questions"].items()):
            ids = [o for o in (["true", "false"] if q == 0 else ["billing", "sales", "tech"] if q == 1
                               else ["0", "1", "2"])]
            k = ids.index(block["option"])
            for span in block["spans"]:
                if (span["start"], span["end"]) == (start, end):
                    assert span["delta_p"] == round(float(again[q][k]) - float(before[q][k]), 4)
                    best = max(range(len(ids)), key=lambda i: again[q][i])
                    assert span.get("top_option", block["option"]) == ids[best]


@pytest.mark.parametrize("value, field", [
    ("yes", "evidence"), (1, "evidence"), ({"top": 0}, "evidence.top"), ({"top": True}, "evidence.top"),
    ({"top": 33}, "evidence.top"), ({"mode": "gradients"}, "evidence.mode"), ({"options": "all"}, "evidence.options"),
    ({"grid": 1}, "evidence.grid"), ({"topk": 3}, "evidence.topk"),
])
def test_a_malformed_value_is_refused_naming_the_field(clef, value, field):
    with pytest.raises(errors.InvalidValue) as refused:
        clef.decide(request(TEXT_STATE, evidence=value))
    assert refused.value.field == field and field in str(refused.value)
    assert refused.value.to_dict()["error"]["code"] == "invalid_value"


def test_strict_accepts_it_and_timings_name_it(clef):
    out = clef.decide(request(TEXT_STATE, evidence=True, options={"strict": True}))
    assert "warnings" not in out and "evidence" in out
    decision = clef.run(clef.prepare(request(TEXT_STATE, evidence=True)))
    assert decision.timings["evidence"] >= 0
    assert "evidence" not in clef.run(clef.prepare(request(TEXT_STATE))).timings


def test_each_occlusion_rerun_decodes_only_the_tokens_after_its_span(clef, monkeypatch):
    """The original prompt is decoded once, in segments ending where each span's tokens begin, with a
    snapshot at each; a re-run restores its own span's and decodes only the tokens after the span."""
    decoded: list[int] = []
    append, forward, keep_points = clef.tower._seq.append, clef.tower.forward, clef.tower.keep_points
    calls: list[tuple[str, bytes, int]] = []

    def counted_append(seq, ids, start, media=None):
        decoded.append(len(ids))
        return append(seq, ids, start, media)

    def phase(name, call):
        def run(ids, *args):
            before = len(decoded)
            out = call(ids, *args)
            calls.append((name, ids.tobytes(), sum(decoded[before:])))
            return out
        return run

    state = "Fine so far. " * 20 + TEXT_STATE + " Then it all went wrong." * 5
    ids = clef.prepare(request(state)).encoded
    monkeypatch.setattr(clef.tower._seq, "append", counted_append)
    monkeypatch.setattr(clef.tower, "forward", phase("forward", forward))
    monkeypatch.setattr(clef.tower, "keep_points", phase("keep", keep_points))
    out = clef.decide(request(state, evidence={"mode": "occlusion", "top": 3}))
    ranges = {(s["start"], s["end"]) for block in out["evidence"]["questions"].values() for s in block["spans"]}
    assert len(ranges) == out["evidence"]["reruns"] >= 3

    def after_span(start: int, end: int) -> tuple[bytes, int]:
        """The occluded prompt's ids, and its tokens from the first one that differs from the original's."""
        again = clef.prepare(request(state[:start] + state[end:])).encoded.ids
        same = next(i for i, (a, b) in enumerate(zip(ids.ids, again)) if a != b)
        return again.tobytes(), len(again) - same

    expected = dict(after_span(*r) for r in ranges)
    (keep,) = [c for c in calls if c[0] == "keep"]
    reruns = [c for c in calls if c[0] == "forward"][1:]
    assert {key: n for _, key, n in reruns} == expected
    # the shared decode ran up to the last span's first token, and no re-run decoded the whole state
    assert keep[2] <= len(ids.ids) and all(n < ids.n_tokens - ids.prefix_tokens for n in expected.values())
    assert sum(expected.values()) + keep[2] < len(ranges) * (ids.n_tokens - ids.prefix_tokens)


def test_a_base_with_fine_tunes_takes_evidence_as_clef_does(tiny_model_dir, tiny_fine_tunes):
    with Clef.load(tiny_model_dir, adapters=tiny_fine_tunes, max_length=2048, threads=2) as models:
        assert not isinstance(models, Clef)  # the set of models, routed by the request's "model"
        for name in (None, "a"):
            body = request(TEXT_STATE, **({} if name is None else {"model": name}))
            plain = models.decide(body)
            out = models.decide(body, evidence={"mode": "occlusion", "top": 1})
            assert json.dumps(out["answers"]) == json.dumps(plain["answers"]) and out["model"] == plain["model"]
            assert out["evidence"]["mode"] == "occlusion" and out["evidence"]["reruns"] >= 1
            assert out["evidence"] == models.decide({**body, "evidence": {"mode": "occlusion", "top": 1}})["evidence"]
            assert bytes_of(models.decide(body, evidence=False)) == bytes_of(plain)
        with pytest.raises(errors.InvalidValue) as refused:
            models.decide(request(TEXT_STATE, model="a"), evidence={"top": 0})
        assert refused.value.field == "evidence.top"


def test_occlusion_on_the_nvfp4_tower_equals_decisions_by_hand(tiny_nvfp4_dir):
    """The other backend's snapshots (its torch caches) resume each re-run as llama.cpp's do."""
    with Clef.load(tiny_nvfp4_dir("nvfp4a16"), max_length=2048, threads=2) as model:
        state = "Fine so far. " * 10 + TEXT_STATE
        out = model.decide(request(state), evidence={"mode": "occlusion", "top": 2})
        assert out["audit"]["backend"] == "torch-nvfp4" and out["evidence"]["reruns"] >= 2
        before = model.probabilities(request(state))
        block = out["evidence"]["questions"]["team"]
        k = ["billing", "sales", "tech"].index(block["option"])
        for span in block["spans"]:
            again = model.probabilities(request(state[:span["start"]] + state[span["end"]:]))
            assert span["delta_p"] == round(float(again[1][k]) - float(before[1][k]), 4)
