"""The request on the wire is one model (``clef_gguf.pipeline.wire``): the parser validates with it and
``/openapi.json`` shows it, per question type, with what the parser checks itself."""

from __future__ import annotations

from clef_gguf.pipeline import request, wire
from clef_gguf.server import schema


def test_the_parser_and_the_document_use_one_model():
    assert request.SystemOneRequest is wire.SystemOneRequest is schema.SystemOneRequest
    assert issubclass(schema.BatchRequest, wire.SystemOneRequest)


def test_the_document_shows_each_question_type_and_keeps_the_field_descriptions():
    doc = wire.SystemOneRequest.model_json_schema()
    questions = doc["properties"]["questions"]
    assert questions["minItems" if "minItems" in questions else "minProperties"] == 1
    assert "at most 64" in questions["description"]
    shown = questions["additionalProperties"]
    assert {ref["$ref"].rsplit("/", 1)[-1] for ref in shown["oneOf"]} == {"NoulQuestion", "ChoiceQuestion",
                                                                           "ScoreQuestion"}
    assert "vision tower" in doc["properties"]["images"]["description"]


def test_validation_stays_the_parsers_lenient_one():
    # what the document shows as required (choice criteria) is the parser's to refuse, by field
    body = wire.SystemOneRequest.model_validate({"state": None, "questions": {"q": {"type": "choice"}}})
    assert body.questions["q"].criteria is None
    body = wire.SystemOneRequest.model_validate({"state": 1, "questions": {}, "images": ["x"], "extra": 2})
    assert body.model_extra == {"extra": 2}
