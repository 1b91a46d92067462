"""Validation: every rule of the request contract, its error class, code and field."""

import pytest

from clef_gguf.core import errors
from clef_gguf.core.questions import NOUL
from clef_gguf.pipeline.request import MAX_DEPTH, parse_json, parse_request

NOUL_DEFAULTS = dict(NOUL.fixed)  # the registry's default descriptions


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
    ({"state": "s", "questions": {"c": {"type": "choice"}}}, errors.MissingField,
     "questions.c.criteria"),
    ({"state": "s", "questions": {"c": {"type": "choice", "criteria": {}}}},
     errors.InvalidCriteria, "questions.c.criteria"),
    ({"state": "s", "questions": {"s": {"type": "score", "criteria": []}}},
     errors.InvalidCriteria, "questions.s.criteria"),
    ({"state": "s", "questions": {"c": {"type": "choice", "criteria": ["a", "b"]}}},
     errors.InvalidCriteria, "questions.c.criteria"),
    ({"state": "s", "questions": {"s": {"type": "score", "criteria": {"a": 1, "b": 2}}}},
     errors.InvalidCriteria, "questions.s.criteria"),
    ({"state": "s", "questions": {"n": {"type": "noul", "criteria": ["yes", "no"]}}},
     errors.InvalidCriteria, "questions.n.criteria"),
    ({"state": "s", "images": [1], "questions": {"q": {"type": "noul"}}},
     errors.InvalidValue, "images.0"),
    ({"state": "s", "images": [{"data": "AAAA", "media_type": 7}], "questions": {"q": {"type": "noul"}}},
     errors.InvalidValue, "images.0.media_type"),
    ({"state": "s", "videos": [[0]], "questions": {"q": {"type": "noul"}}},
     errors.InvalidValue, "videos.0.0"),
    ({"state": "\ud800x", "questions": {"q": {"type": "noul"}}}, errors.InvalidValue, "state"),
    ({"state": {"a": ["ok", "\udfff"]}, "questions": {"q": {"type": "noul"}}},
     errors.InvalidValue, "state.a.1"),
    ({"state": "s", "questions": {"q\ud800": {"type": "noul"}}}, errors.InvalidValue,
     "questions"),
    ({"state": [[[[]]]], "questions": {"q": {"type": "noul"}}}, None, None),  # depth is fine
])
def test_invalid_requests(request_body, cls, field):
    if cls is None:
        parse_request(request_body)
        return
    with pytest.raises(cls) as info:
        parse_request(request_body)
    err = info.value
    assert type(err) is cls
    assert err.field == field
    assert err.status == 422
    payload = err.to_dict()["error"]
    assert payload["code"] == cls.code and payload["message"] and payload["field"] == field


def test_nesting_past_the_limit_is_refused_with_its_path():
    deep = "x"
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(errors.InvalidValue) as info:
        parse_request({"state": {"doc": deep}, "questions": {"q": {"type": "noul"}}})
    assert info.value.field.startswith("state.doc.0.0")
    nested = "x"
    for _ in range(MAX_DEPTH - 2):
        nested = [nested]
    parse_request({"state": nested, "questions": {"q": {"type": "noul"}}})


# What the reference answers (spec §8.3: it checks nothing more), with what we report ignored.
@pytest.mark.parametrize("request_body, ignored", [
    ({"state": "s", "id": "rec-7", "questions": {"q": {"type": "noul"}}}, ["id"]),
    ({"state": "s", "images": [], "videos": [], "questions": {"q": {"type": "noul"}}}, []),
    ({"state": "s", "questions": {"q": {"type": "noul", "instruction": "typo"}}},
     ["questions.q.instruction"]),
    ({"state": "s", "questions": {"n": {"type": "noul", "criteria": {"maybe": "?"}}}},
     ["questions.n.criteria.maybe"]),
    ({"state": "s", "options": {"near_tie_margin": 0.1}, "questions": {"q": {"type": "noul"}}},
     ["options.near_tie_margin"]),
    ({"state": "s", "calibration": "v2", "questions": {"q": {"type": "noul"}}}, ["calibration"]),
    ({"state": "s", "media_kwargs": {"max_pixels": 9}, "questions": {"q": {"type": "noul"}}},
     ["media_kwargs"]),
    ({"state": "s", "questions": {"q": {"type": "noul", "instructions": 5}}}, []),
    ({"state": "s", "questions": {"q": {"type": "noul", "instructions": True}}}, []),
    ({"state": "s", "questions": {"": {"type": "noul", "instructions": "named"}}}, []),
    ({"state": "s", "questions": {"c": {"type": "choice", "criteria": {"a": "x"}}}}, []),
    ({"state": "s", "questions": {"c": {"type": "choice", "criteria": {"": 1, "b": 2}}}}, []),
    ({"state": "s", "questions": {"s": {"type": "score", "criteria": ["x"]}}}, []),
    ({"state": "s", "questions": {"s": {"type": "score", "criteria": list("abcdefghijk")}}}, []),
    ({"state": "s", "questions": {"c": {"type": "choice",
                                        "criteria": {str(i): None for i in range(256)}}}}, []),
    ({"state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}, []),
])
def test_reference_answers_these_so_do_we(request_body, ignored):
    r = parse_request(request_body)
    assert [w["field"] for w in r.warnings] == ignored
    assert all(w["code"] == "ignored_field" and w["field"] in w["message"] for w in r.warnings)


@pytest.mark.parametrize("strict", [False, True])
def test_with_a_calibration_loaded_the_requested_one_is_kept_for_the_runtime(strict):
    for asked in (None, "cal-0123456789abcdef", "none", 7):
        sent = {"state": "s", "questions": {"q": {"type": "noul"}}}
        if asked is not None:
            sent["calibration"] = asked
        r = parse_request(sent, strict=strict, calibrated=True)
        assert r.calibration == asked and r.warnings == ()  # Clef.prepare matches it to the loaded one
    plain = parse_request({"state": "s", "calibration": "v2", "questions": {"q": {"type": "noul"}}})
    assert plain.calibration == "v2" and [w["field"] for w in plain.warnings] == ["calibration"]


@pytest.mark.parametrize("instructions, rendered", [(5, "5"), (True, "true"), (0, "0"),
                                                     (1.5, "1.5"), (False, "false")])
def test_any_json_instructions_render_like_the_reference(instructions, rendered):
    from clef_gguf.pipeline.encode import render

    q = parse_request(body(q={"type": "noul", "instructions": instructions})).questions[0]
    assert q.instruction == instructions and render(q.instruction) == rendered  # no id fallback


@pytest.mark.parametrize("request_body, cls, field", [
    ({"state": "s", "questions": {"q": {"type": "noul", "instruction": "typo"}}},
     errors.UnknownField, "questions.q.instruction"),
    ({"state": "s", "extra": 1, "questions": {"q": {"type": "noul"}}}, errors.UnknownField, "extra"),
    ({"state": "s", "questions": {"": {"type": "noul"}}}, errors.EmptyQuestionId, "questions"),
    ({"state": "s", "questions": {"c": {"type": "choice", "criteria": {"a": "x"}}}},
     errors.TooFewOptions, "questions.c.criteria"),
    ({"state": "s", "questions": {"c": {"type": "choice",
                                        "criteria": {str(i): None for i in range(256)}}}},
     errors.TooManyOptions, "questions.c.criteria"),
    ({"state": "s", "questions": {"c": {"type": "choice", "criteria": {"": 1, "b": 2}}}},
     errors.InvalidCriteria, "questions.c.criteria"),
    ({"state": "s", "questions": {"s": {"type": "score", "criteria": ["x"]}}},
     errors.TooFewOptions, "questions.s.criteria"),
    ({"state": "s", "questions": {"s": {"type": "score", "criteria": list("abcdefghijk")}}},
     errors.TooManyOptions, "questions.s.criteria"),
    ({"state": "s", "questions": {"n": {"type": "noul", "criteria": {"maybe": "?"}}}},
     errors.UnknownField, "questions.n.criteria.maybe"),
    ({"state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}},
     errors.TooManyQuestions, "questions"),
    ({"state": "s", "calibration": "v2", "questions": {"q": {"type": "noul"}}},
     errors.Unsupported, "calibration"),
    ({"state": "s", "options": {"near_tie_margin": 0.1}, "questions": {"q": {"type": "noul"}}},
     errors.UnknownField, "options.near_tie_margin"),
])
def test_strict_refuses_what_the_reference_ignores(request_body, cls, field):
    for strict_body, kwargs in (({**request_body, "options": {**request_body.get("options", {}),
                                                              "strict": True}}, {}),
                                (request_body, {"strict": True})):
        with pytest.raises(cls) as info:
            parse_request(strict_body, **kwargs)
        assert type(info.value) is cls and info.value.field == field


def test_limits_accept_the_edges():
    r = parse_request({"state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(64)}},
                      strict=True)
    assert len(r.questions) == 64
    r = parse_request(body(c={"type": "choice", "criteria": {str(i): None for i in range(255)}}),
                      strict=True)
    assert len(r.questions[0].options) == 255
    r = parse_request(body(s={"type": "score", "criteria": list("abcdefghij")}), strict=True)
    assert [o.id for o in r.questions[0].options] == [str(i) for i in range(10)]
    r = parse_request(body(c={"type": "choice", "criteria": {"a": 1, "b": 2}}), strict=True)
    assert r.questions[0].report_order == ("a", "b") and not r.warnings


@pytest.mark.parametrize("raw, field", [
    (b'{"state": 1, "state": 2, "questions": {}}', "state"),
    (b'{"state": 1, "questions": {"q": {"type": "noul", "type": "score"}}}', "type"),
    (b'{"state": NaN, "questions": {}}', None),
    (b'{"state": -Infinity, "questions": {}}', None),
    (b"\xff{}", None),
    (b"   ", None),
    (b"[" * 100_000 + b"]" * 100_000, None),
    (b"{bad", None),
])
def test_the_json_reader_refuses_what_json_would_take_silently(raw, field):
    with pytest.raises(errors.InvalidJson) as info:
        parse_json(raw)
    assert info.value.field == field and info.value.status == 422 and info.value.message


LONG = "9" * 5000  # past Python's 4,300-digit int/str conversion limit


@pytest.mark.parametrize("raw, field", [
    ('{"state": %s, "questions": {"q": {"type": "noul"}}}' % LONG, "state"),
    ('{"state": {"a": [1, -%s]}, "questions": {"q": {"type": "noul"}}}' % LONG, "state.a.1"),
    ('[%s]' % LONG, "0"),
])
def test_a_number_past_the_digit_limit_is_refused_by_field(raw, field):
    with pytest.raises(errors.InvalidValue) as info:
        parse_json(raw)
    assert info.value.field == field and info.value.status == 422
    assert "5000 digits" in info.value.message and "4300" in info.value.message


def test_a_long_number_within_the_limit_is_kept():
    assert parse_json('{"n": %s}' % ("9" * 4300))["n"] == 10 ** 4300 - 1


def test_a_python_int_past_the_digit_limit_is_refused_by_field():
    with pytest.raises(errors.InvalidValue) as info:
        parse_request({"state": {"n": 10 ** 5000}, "questions": {"q": {"type": "noul"}}})
    assert info.value.field == "state.n" and "4300" in info.value.message
    parse_request({"state": {"n": 10 ** 4299}, "questions": {"q": {"type": "noul"}}})  # at the limit


def test_the_json_reader_keeps_numbers_and_order():
    value = parse_json('{"b": 1, "a": 1.0, "c": [1e16, -0.0]}')
    assert list(value) == ["b", "a", "c"] and type(value["b"]) is int and type(value["a"]) is float


def test_error_codes_are_stable_and_distinct():
    classes = [errors.MissingField, errors.UnknownField, errors.InvalidValue,
               errors.InvalidQuestionType, errors.NoQuestions, errors.TooManyQuestions,
               errors.EmptyQuestionId, errors.InvalidCriteria, errors.TooFewOptions,
               errors.TooManyOptions, errors.Unsupported, errors.ContextTooLarge,
               errors.InvalidJson]
    codes = [c.code for c in classes]
    assert len(set(codes)) == len(codes)
    assert errors.ContextTooLarge.status == 413


def test_every_error_class_has_its_own_code():
    import inspect

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.ClefError)]
    codes = [c.code for c in classes]
    assert len(classes) > 20 and len(set(codes)) == len(codes), sorted(codes)
