"""OpenAPI descriptions of the server's bodies (documentation only).

The routes read raw bytes with Python ``json`` instead of letting FastAPI parse a pydantic model:
the prompt depends on the int/float distinction and key order, and validation errors must use our
own ``{"error": {...}}`` body. So the schemas are written here by hand for ``/openapi.json``.
"""

from __future__ import annotations

ANY_JSON: dict = {}
ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["code", "message", "field"],
        "properties": {"code": {"type": "string", "description": "stable, e.g. invalid_value, "
                                "context_too_large, unsupported, queue_full"},
                       "message": {"type": "string"},
                       "field": {"type": ["string", "null"],
                                 "description": "dotted path of the offending request field"}}}},
}
QUESTION = {
    "type": "object", "required": ["type"], "additionalProperties": False,
    "properties": {
        "type": {"enum": ["noul", "choice", "score"]},
        "instructions": {"description": "string, object or array; defaults to the question id"},
        "criteria": {"description": "noul: optional {true, false}; choice: {option_id: "
                     "description}; score: [level description, ...] lowest first"},
    },
}
QUESTIONS = {"type": "object", "additionalProperties": QUESTION, "minProperties": 1,
             "maxProperties": 64, "description": "question id -> question; order matters"}
OPTIONS = {"type": "object", "additionalProperties": False,
           "properties": {"truncate_state": {
               "type": "boolean", "default": False,
               "description": "cut an over-long state to fit instead of answering 413"}}}
REQUEST = {
    "type": "object", "required": ["state", "questions"],
    "properties": {"model": {"type": "string", "description": "echoed back"},
                   "state": {"description": "any JSON value; a string is used raw"},
                   "questions": QUESTIONS, "options": OPTIONS,
                   "calibration": {"type": "string", "description": "only \"none\""}},
}
USAGE = {"type": "object", "properties": {"input_tokens": {"type": "integer"},
                                          "output_tokens": {"type": "integer"}}}
AUDIT = {
    "type": "object",
    "properties": {"model_hash": {"type": "string"}, "calibration_version": {"type": "string"},
                   "prompt_template_sha256": {"type": "array", "items": {"type": "string"}},
                   "allowed_token_set_hash": {"type": "array", "items": {"type": "string"}},
                   "input_tokens": {"type": "array", "items": {"type": "integer"}},
                   "backend": {"type": "string"}, "precision": {"type": "string"}},
}
ANSWERS = {"type": "object", "description": "question id -> answer, in request order",
           "additionalProperties": {"type": "object", "required": ["type"]}}
RESPONSE = {
    "type": "object", "required": ["model", "answers", "usage", "audit"],
    "properties": {"model": {"type": "string"}, "answers": ANSWERS, "usage": USAGE,
                   "audit": AUDIT, "truncated": {"type": "boolean"}},
}
BATCH_ENTRY = {"oneOf": [
    {"type": "string"},
    {"type": "object", "required": ["text"],
     "properties": {"id": {"type": "string"}, "text": {"description": "this input's state"},
                    "questions": QUESTIONS}},
]}
BATCH_REQUEST = {"oneOf": [
    {"type": "object", "required": ["state"], "title": "inputs sharing one question set",
     "properties": {"model": {"type": "string"},
                    "state": {"type": "array", "items": BATCH_ENTRY},
                    "questions": QUESTIONS, "options": OPTIONS}},
    {"type": "object", "required": ["requests"], "title": "a list of full requests",
     "properties": {"model": {"type": "string", "description": "default for requests without"},
                    "requests": {"type": "array", "items": REQUEST}}},
]}
BATCH_RESPONSE = {
    "type": "object", "required": ["model", "results", "usage", "audit"],
    "properties": {
        "model": {"type": "string"}, "usage": USAGE, "audit": AUDIT,
        "results": {"type": "array", "description": "in input order", "items": {
            "type": "object", "required": ["id"],
            "properties": {"id": {"type": "string"}, "answers": ANSWERS,
                           "error": ERROR["properties"]["error"],
                           "truncated": {"type": "boolean"}}}},
    },
}
MODELS = {"type": "object", "properties": {"models": {"type": "array", "items": {
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string"}, "quant": {"type": "string"},
                   "files": {"type": "object", "additionalProperties": {"type": ["string", "null"]},
                             "description": "file name -> sha256"},
                   "revision": {"type": ["string", "null"]}}}}}}
HEALTH = {"type": "object", "required": ["status"],
          "properties": {"status": {"enum": ["ok", "loading", "error"]}}}


def body(schema: dict) -> dict:
    """``openapi_extra`` for a route whose JSON body the handler parses itself."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def json_content(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def errors(*statuses: int) -> dict:
    what = {401: "missing or wrong API key", 413: "body over the limit, or too long for the "
            "window without options.truncate_state", 422: "invalid JSON or invalid request",
            429: "queue full; see Retry-After", 503: "model loading; see Retry-After"}
    return {s: json_content(ERROR, what[s]) for s in statuses}
