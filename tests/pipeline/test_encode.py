"""Golden cases for every rule of spec §3, on the tiny release's byte-level BPE tokenizer."""

import unicodedata

import numpy as np
import pytest

from clef_gguf.core import errors
from clef_gguf.pipeline.encode import PREFIX, SUFFIX, SYSTEM, Encoder, option_text, render
from clef_gguf.pipeline.request import parse_request


@pytest.fixture(scope="module")
def encoder(tiny_release):
    return Encoder.from_file(tiny_release / "tokenizer.json")


def encode(encoder, body, **kw):
    return encoder.encode(parse_request(body, **kw))


def text(encoder, ids):
    return encoder.tokenizer.decode(list(map(int, ids)), skip_special_tokens=False)


def ids_of(encoder, piece):
    return encoder.tokenizer.encode(piece, add_special_tokens=False).ids


# ---------------------------------------------------------------- render
@pytest.mark.parametrize("value, expected", [
    ("raw \"text\"\n", "raw \"text\"\n"),
    ({"b": 1, "a": {"d": None, "c": True}}, '{"a":{"c":true,"d":null},"b":1}'),
    ([1250.0, 1e-05, 1e16, 1.5e-07, 3, -0.0], "[1250.0,1e-05,1e+16,1.5e-07,3,-0.0]"),
    ({"é": "naïve", "ctl": "a\tb\u0000"}, '{"ctl":"a\\tb\\u0000","é":"naïve"}'),
    (None, "null"), (False, "false"), (["x"], '["x"]'),
])
def test_render(value, expected):
    assert render(value) == expected


def test_option_object_puts_description_before_id():
    assert option_text("overdue", "Invoice is past due.") == \
        '{"description":"Invoice is past due.","option_id":"overdue"}'
    assert option_text("other", None) == '{"option_id":"other"}'
    assert option_text("x", {"b": 2, "a": 1}) == '{"description":{"a":1,"b":2},"option_id":"x"}'


# ---------------------------------------------------------------- the whole prompt
GOLDEN_BODY = {
    "state": {"amount": 1250.0, "rate": 1e-05, "note": "naïve"},
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is it urgent?",
                   "criteria": {"true": None}},
        "team": {"type": "choice", "criteria": {"ops": "Operations", "billing": None}},
        "risk": {"type": "score", "instructions": {"ask": "risk"}, "criteria": ["low", "high"]},
    },
}

GOLDEN_TEXT = (
    "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n<|im_start|>user\nSTATE:\n"
    '{"amount":1250.0,"note":"naïve","rate":1e-05}'
    "\n\nSCHEMA FIELDS:\n"
    "\nFIELD 1\nID: urgent\nTYPE: noul\nINSTRUCTION: Is it urgent?\nALLOWED OPTIONS:\n"
    'OPTION 1: {"option_id":"true"}\n'
    'OPTION 2: {"description":"The proposition is false or the answer is no.","option_id":"false"}\n'
    "END FIELD\n"
    "\nFIELD 2\nID: team\nTYPE: choice\nINSTRUCTION: team\nALLOWED OPTIONS:\n"
    'OPTION 1: {"option_id":"billing"}\n'
    'OPTION 2: {"description":"Operations","option_id":"ops"}\n'
    "END FIELD\n"
    "\nFIELD 3\nID: risk\nTYPE: score\nINSTRUCTION: {\"ask\":\"risk\"}\nALLOWED OPTIONS:\n"
    'OPTION 1: {"description":"low","option_id":"0"}\n'
    'OPTION 2: {"description":"high","option_id":"1"}\n'
    "END FIELD\n"
    "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
)


def test_golden_prompt_text_and_spans(encoder):
    enc = encode(encoder, GOLDEN_BODY)
    assert text(encoder, enc.ids) == GOLDEN_TEXT
    assert enc.ids.dtype == np.int32
    spans = [text(encoder, enc.ids[s:e]) for s, e in enc.question_spans]
    assert spans == ["Is it urgent?", "team", '{"ask":"risk"}']
    options = [text(encoder, enc.ids[s:e]) for s, e in enc.option_spans]
    assert options == [
        '{"option_id":"true"}',
        '{"description":"The proposition is false or the answer is no.","option_id":"false"}',
        '{"option_id":"billing"}', '{"description":"Operations","option_id":"ops"}',
        '{"description":"low","option_id":"0"}', '{"description":"high","option_id":"1"}']
    assert enc.option_counts == (2, 2, 2) and enc.types == (0, 1, 2)
    assert enc.ids[-1] == ids_of(encoder, ":")[-1]


def test_pieces_are_tokenized_separately(encoder):
    enc = encode(encoder, GOLDEN_BODY)
    prefix = ids_of(encoder, PREFIX)
    suffix = ids_of(encoder, SUFFIX)
    assert enc.ids[:len(prefix)].tolist() == prefix
    assert enc.ids[-len(suffix):].tolist() == suffix
    s, e = enc.option_spans[3]
    assert enc.ids[s:e].tolist() == ids_of(encoder, '{"description":"Operations","option_id":"ops"}')
    # The state piece starts right after the prefix, tokenized on its own.
    state = ids_of(encoder, render(GOLDEN_BODY["state"]))
    assert enc.ids[len(prefix):len(prefix) + len(state)].tolist() == state
    assert enc.state_tokens == len(state)


def test_choice_options_sorted_by_code_point(encoder):
    crit = {"b": None, "a": None, "10": None, "9": None, "A": None}
    enc = encode(encoder, {"state": "", "questions": {"c": {"type": "choice", "criteria": crit}}})
    got = [text(encoder, enc.ids[s:e]) for s, e in enc.option_spans]
    assert got == [option_text(k, None) for k in ["10", "9", "A", "a", "b"]]


def test_questions_keep_insertion_order(encoder):
    enc = encode(encoder, {"state": "x", "questions": {"zeta": {"type": "noul"},
                                                       "alpha": {"type": "noul"}}})
    assert [text(encoder, enc.ids[s:e]) for s, e in enc.question_spans] == ["zeta", "alpha"]


def test_special_token_text_inside_state_becomes_the_special_id(encoder):
    enc = encode(encoder, {"state": "hi <|im_end|> there", "questions": {"q": {"type": "noul"}}})
    im_end = encoder.tokenizer.token_to_id("<|im_end|>")
    n_prefix = len(ids_of(encoder, PREFIX))
    state_ids = enc.ids[n_prefix:n_prefix + enc.state_tokens].tolist()
    assert im_end in state_ids


def test_decomposed_unicode_is_normalised_like_the_release_tokenizer(encoder):
    nfc, nfd = "résumé", unicodedata.normalize("NFD", "résumé")
    assert nfc != nfd
    a = encode(encoder, {"state": nfc, "questions": {"q": {"type": "noul"}}})
    b = encode(encoder, {"state": nfd, "questions": {"q": {"type": "noul"}}})
    assert a.ids.tolist() == b.ids.tolist()


def test_window_refuses_by_default_and_truncates_on_request(encoder):
    small = Encoder(encoder.tokenizer, max_length=400)
    body = {"state": "word " * 2000, "questions": {"q": {"type": "noul"}}}
    with pytest.raises(errors.ContextTooLarge) as info:
        encode(small, body)
    assert info.value.field == "state" and info.value.status == 413
    enc = encode(small, body, truncate_state=True)
    assert enc.truncated and enc.n_tokens == 400
    full_state = ids_of(encoder, body["state"])
    n_prefix = len(ids_of(encoder, PREFIX))
    assert enc.ids[n_prefix:n_prefix + enc.state_tokens].tolist() == full_state[:enc.state_tokens]
    # Spans still point at the schema after the cut.
    assert text(encoder, enc.ids[slice(*enc.question_spans[0])]) == "q"


def test_schema_longer_than_window_is_refused_even_with_truncation(encoder):
    small = Encoder(encoder.tokenizer, max_length=60)
    with pytest.raises(errors.ContextTooLarge) as info:
        encode(small, {"state": "", "questions": {"q": {"type": "noul"}}}, truncate_state=True)
    assert "before state" in info.value.message and info.value.field == "questions"


def test_fitting_request_is_not_marked_truncated(encoder):
    enc = encode(encoder, {"state": "short", "questions": {"q": {"type": "noul"}}},
                 truncate_state=True)
    assert not enc.truncated


# ---------------------------------------------------------------- the bounded prefix
@pytest.mark.parametrize("words, room, whole", [(50, 1000, True), (20000, 100, False), (20000, 3000, False)])
def test_the_state_ids_and_their_characters_come_from_one_bounded_tokenization(encoder, words, room, whole):
    from clef_gguf.pipeline.encode import CUT_MARGIN, bounded_encoding
    from clef_gguf.pipeline.evidence_spans import state_offsets

    state = " ".join(f"w{i % 97}" for i in range(words))
    encoding, exact = bounded_encoding(encoder.tokenizer, state, room)
    full = ids_of(encoder, state)
    assert exact is whole and encoding.ids[:room] == full[:room]
    if not exact:  # a long state: a bounded prefix, seen CUT_MARGIN tokens past the room
        assert room + CUT_MARGIN < len(encoding.ids) < len(full)
    ids, ids_exact = encoder.state_ids(state, room)
    assert (ids, ids_exact) == (encoding.ids, exact)
    kept = np.array(ids[:room])
    assert state_offsets(encoder, state, kept) == [tuple(o) for o in encoding.offsets[:len(kept)]]
