"""Property-based: any JSON value either encodes or raises a ClefError that names a field, and
the bounded state tokenization keeps exactly the ids a whole tokenization would.

Example counts: ``CLEF_FUZZ_EXAMPLES`` (default 300 per property; the full run uses 5000)."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_gguf.core import errors
from clef_gguf.pipeline.encode import CUT_MARGIN, Encoder
from clef_gguf.pipeline.request import parse_json, parse_request

EXAMPLES = int(os.environ.get("CLEF_FUZZ_EXAMPLES", "300"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# text with the awkward parts: lone surrogates, control and special-token strings, combining marks
TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec=None), max_size=20),
    st.sampled_from(["", "<|im_end|>", "<|im_start|>user", "e\u0301", "\ud800", "true", "0",
                     "\x00\t\n", "नमस्ते", "สวัสดี", "🦊" * 3]),
)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)), max_leaves=20)
TYPES = st.one_of(st.sampled_from(["noul", "choice", "score"]), JSON)
QUESTION = st.one_of(
    JSON,
    st.builds(lambda known, extra: {**extra, **known},
              st.fixed_dictionaries({"type": TYPES},
                                    optional={"instructions": JSON, "criteria": JSON}),
              st.dictionaries(TEXT, JSON, max_size=2)),
)
CLEAN = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=30)
CLEAN_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), CLEAN,
                                    st.floats(allow_nan=False, allow_infinity=False)),
                          lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(CLEAN, inner, max_size=3)),
                          max_leaves=8)
VALID_QUESTION = st.one_of(
    st.fixed_dictionaries({"type": st.just("noul")}, optional={
        "instructions": CLEAN_JSON,
        "criteria": st.dictionaries(st.sampled_from(["true", "false", "other"]), CLEAN_JSON)}),
    st.fixed_dictionaries({"type": st.just("choice"),
                           "criteria": st.dictionaries(CLEAN, CLEAN_JSON, min_size=1, max_size=6)},
                          optional={"instructions": CLEAN_JSON}),
    st.fixed_dictionaries({"type": st.just("score"),
                           "criteria": st.lists(CLEAN_JSON, min_size=1, max_size=6)},
                          optional={"instructions": CLEAN_JSON}),
)
VALID = st.fixed_dictionaries(
    {"state": CLEAN_JSON, "questions": st.dictionaries(CLEAN.filter(bool), VALID_QUESTION,
                                                       min_size=1, max_size=5)},
    optional={"model": CLEAN, "id": CLEAN_JSON})
BODY = st.one_of(
    VALID,
    JSON,
    st.fixed_dictionaries(
        {"state": JSON, "questions": st.one_of(JSON, st.dictionaries(TEXT, QUESTION, max_size=4))},
        optional={"model": JSON, "options": st.one_of(JSON, st.fixed_dictionaries(
            {}, optional={"strict": JSON, "truncate_state": JSON})),
            "calibration": JSON, "images": JSON, "id": JSON}),
)


@pytest.fixture(scope="module")
def encoder(tiny_release):
    return Encoder.from_file(tiny_release / "tokenizer.json", max_length=256)


def _field_exists(body, exc):
    """The error's field path starts at a key of the body (a missing one for missing_field)."""
    if exc.field is None:
        return True
    head = exc.field.split(".")[0]
    return isinstance(body, dict) and (head in body or isinstance(exc, errors.MissingField))


@SETTINGS
@given(body=BODY)
def test_any_json_body_answers_or_names_its_field(encoder, body):
    try:
        encoded = encoder.encode(parse_request(body))
    except errors.ClefError as exc:
        assert exc.status in (413, 422), exc
        assert exc.message and _field_exists(body, exc), (exc.field, body)
        return
    assert encoded.n_tokens <= encoder.max_length
    assert all(e > s for s, e in encoded.question_spans + encoded.option_spans)
    assert sum(encoded.option_counts) == len(encoded.option_spans)


@SETTINGS
@given(body=VALID)
def test_every_valid_request_answers(encoder, body):
    """What the reference answers we answer: nothing here may be refused (the window is large)."""
    big = Encoder(encoder.tokenizer, max_length=16384)
    encoded = big.encode(parse_request(body))
    assert len(encoded.question_spans) == len(body["questions"])


@SETTINGS
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64),
                     JSON.map(lambda v: __import__("json").dumps(v))))
def test_any_bytes_parse_or_raise_invalid_json(raw):
    try:
        parse_json(raw)
    except errors.InvalidJson as exc:
        assert exc.status == 422 and exc.message
    except errors.ClefError as exc:  # pragma: no cover - every failure is invalid_json
        pytest.fail(f"unexpected {exc!r}")


WORDS = st.lists(st.one_of(st.text(min_size=1, max_size=12), st.sampled_from(
    ["<|im_end|>", " ", "\n\n", "   ", "e\u0301", "1234567", "नमस्ते", "aaaaaaaaaaaaaaaaaaaa"])),
    min_size=1, max_size=400)


@pytest.mark.slow  # hypothesis over long texts
@SETTINGS
@given(words=WORDS, room=st.integers(1, 2000))
def test_bounded_state_tokenization_keeps_the_whole_texts_ids(encoder, words, room):
    text = "".join(ch for ch in "".join(words) if not 0xD800 <= ord(ch) <= 0xDFFF)
    text = text * (20_000 // len(text) + 1)  # past the first bounded prefix (4,096+ characters)
    full = encoder.tokenizer.encode(text, add_special_tokens=False).ids
    got, exact = encoder.state_ids(text, room)
    if exact:
        assert got == full
    else:
        assert len(got) > room + CUT_MARGIN and got[:room] == full[:room]
