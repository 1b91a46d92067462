"""Validation: every rule of the request contract, its error class, code and field."""

import pytest

from clef_gguf import errors
from clef_gguf.request import NOUL_DEFAULTS, parse_request


def body(**questions):
    return {"state": "s", "questions": questions or {"q": {"type": "noul"}}}


def test_minimal_request_without_model():
    r = parse_request({"state": None, "questions": {"ok": {"type": "noul"}}})
    assert r.model is None and r.state is None
    (q,) = r.questions
    assert q.instruction == "ok"  # id fallback
    assert [(o.id, o.description) for o in q.options] == [
        ("true", NOUL_DEFAULTS["true"]), ("false", NOUL_DEFAULTS["false"])]


@pytest.mark.parametrize("instructions", [None, ""])
def test_instruction_falls_back_to_id(instructions):
    r = parse_request(body(q1={"type": "noul", "instructions": instructions}))
    assert r.questions[0].instruction == "q1"


@pytest.mark.parametrize("instructions", [[], {}, {"b": 1, "a": [1.5]}])
def test_non_string_instructions_are_kept(instructions):
    r = parse_request(body(q1={"type": "noul", "instructions": instructions}))
    assert r.questions[0].instruction == instructions


def test_noul_criteria_merge_and_explicit_null():
    r = parse_request(body(q={"type": "noul", "criteria": {"true": None}}))
    opts = r.questions[0].options
    assert opts[0].description is None
    assert opts[1].description == NOUL_DEFAULTS["false"]


def test_choice_sorted_for_prompt_request_order_for_report():
    crit = {"b": "B", "a": None, "10": "ten", "9": {"k": 1}, "A": "cap"}
    q = parse_request(body(c={"type": "choice", "criteria": crit})).questions[0]
    assert [o.id for o in q.options] == ["10", "9", "A", "a", "b"]
    assert q.report_order == ("b", "a", "10", "9", "A")


def test_score_levels_are_indexed():
    q = parse_request(body(s={"type": "score", "criteria": ["low", None, {"x": 1}]})).questions[0]
    assert [o.id for o in q.options] == ["0", "1", "2"]
    assert q.legend == ("low", None, {"x": 1})


def test_question_order_is_insertion_order():
    r = parse_request(body(z={"type": "noul"}, a={"type": "noul"}, m={"type": "noul"}))
    assert [q.id for q in r.questions] == ["z", "a", "m"]


def test_truncate_state_option():
    assert parse_request({**body(), "options": {"truncate_state": True}}).truncate_state
    assert parse_request(body(), truncate_state=True).truncate_state
    assert not parse_request(body()).truncate_state


@pytest.mark.parametrize("request_body, cls, field", [
    ("not an object", errors.InvalidValue, None),
    ({"questions": {"q": {"type": "noul"}}}, errors.MissingField, "state"),
    ({"state": "s"}, errors.MissingField, "questions"),
    ({"state": "s", "questions": {}}, errors.NoQuestions, "questions"),
    ({"state": "s", "questions": []}, errors.InvalidValue, "questions"),
    ({"state": "s", "questions": {"q": "noul"}}, errors.InvalidValue, "questions.q"),
    ({"state": "s", "model": 3, "questions": {"q": {"type": "noul"}}}, errors.InvalidValue, "model"),
    ({"state": "s", "questions": {"q": {"type": "multi"}}}, errors.InvalidQuestionType,
     "questions.q.type"),
    ({"state": "s", "questions": {"q": {}}}, errors.MissingField, "questions.q.type"),
    ({"state": "s", "questions": {"q": {"type": "noul", "instruction": "typo"}}},
     errors.UnknownField, "questions.q.instruction"),
    ({"state": "s", "extra": 1, "questions": {"q": {"type": "noul"}}}, errors.UnknownField, "extra"),
    ({"state": "s", "questions": {"": {"type": "noul"}}}, errors.EmptyQuestionId, "questions"),
    ({"state": "s", "questions": {"q": {"type": "noul", "instructions": 5}}}, errors.InvalidValue,
     "questions.q.instructions"),
    ({"state": "s", "questions": {"c": {"type": "choice"}}}, errors.MissingField,
     "questions.c.criteria"),
    ({"state": "s", "questions": {"c": {"type": "choice", "criteria": ["a", "b"]}}},
     errors.InvalidCriteria, "questions.c.criteria"),
    ({"state": "s", "questions": {"c": {"type": "choice", "criteria": {"a": "x"}}}},
     errors.TooFewOptions, "questions.c.criteria"),
    ({"state": "s", "questions": {"c": {"type": "choice",
                                        "criteria": {str(i): None for i in range(256)}}}},
     errors.TooManyOptions, "questions.c.criteria"),
    ({"state": "s", "questions": {"c": {"type": "choice", "criteria": {"": 1, "b": 2}}}},
     errors.InvalidCriteria, "questions.c.criteria"),
    ({"state": "s", "questions": {"s": {"type": "score", "criteria": {"a": 1, "b": 2}}}},
     errors.InvalidCriteria, "questions.s.criteria"),
    ({"state": "s", "questions": {"s": {"type": "score", "criteria": ["x"]}}},
     errors.TooFewOptions, "questions.s.criteria"),
    ({"state": "s", "questions": {"s": {"type": "score", "criteria": list("abcdefghijk")}}},
     errors.TooManyOptions, "questions.s.criteria"),
    ({"state": "s", "questions": {"n": {"type": "noul", "criteria": ["yes", "no"]}}},
     errors.InvalidCriteria, "questions.n.criteria"),
    ({"state": "s", "questions": {"n": {"type": "noul", "criteria": {"maybe": "?"}}}},
     errors.InvalidCriteria, "questions.n.criteria.maybe"),
    ({"state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}},
     errors.TooManyQuestions, "questions"),
    ({"state": "s", "images": [{"data": "AAAA"}], "questions": {"q": {"type": "noul"}}},
     errors.Unsupported, "images"),
    ({"state": "s", "videos": [[0]], "questions": {"q": {"type": "noul"}}},
     errors.Unsupported, "videos"),
    ({"state": "s", "calibration": "v2", "questions": {"q": {"type": "noul"}}},
     errors.Unsupported, "calibration"),
    ({"state": "s", "options": {"near_tie_margin": 0.1}, "questions": {"q": {"type": "noul"}}},
     errors.UnknownField, "options.near_tie_margin"),
])
def test_invalid_requests(request_body, cls, field):
    with pytest.raises(cls) as info:
        parse_request(request_body)
    err = info.value
    assert type(err) is cls
    assert err.field == field
    assert err.status == 422
    payload = err.to_dict()["error"]
    assert payload["code"] == cls.code and payload["message"] and payload["field"] == field


def test_limits_accept_the_edges():
    parse_request({"state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(64)}})
    parse_request(body(c={"type": "choice", "criteria": {str(i): None for i in range(255)}}))
    parse_request(body(s={"type": "score", "criteria": list("abcdefghij")}))
    parse_request(body(c={"type": "choice", "criteria": {"a": 1, "b": 2}}))


def test_error_codes_are_stable_and_distinct():
    classes = [errors.MissingField, errors.UnknownField, errors.InvalidValue,
               errors.InvalidQuestionType, errors.NoQuestions, errors.TooManyQuestions,
               errors.EmptyQuestionId, errors.InvalidCriteria, errors.TooFewOptions,
               errors.TooManyOptions, errors.Unsupported, errors.ContextTooLarge]
    codes = [c.code for c in classes]
    assert len(set(codes)) == len(codes)
    assert errors.ContextTooLarge.status == 413
