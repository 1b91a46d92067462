"""OpenAPI descriptions of the server's bodies (documentation only).

The routes read raw bytes with Python ``json`` instead of letting FastAPI parse a pydantic model:
the prompt depends on the int/float distinction and key order, and validation errors must use our
own ``{"error": {...}}`` body. So the schemas are written here by hand for ``/openapi.json``.

They are kept exact where JSON Schema can say it (the API fuzz test checks every response against
them), and describe a subset of what is accepted where it cannot (lone surrogates, prompts too
long for the window, instructions that render to no tokens are refused only by the server).
"""

from __future__ import annotations

ANY_JSON: dict = {}
ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["code", "message", "field"], "additionalProperties": False,
        "properties": {"code": {"type": "string", "description": "stable, e.g. invalid_value, "
                                "context_too_large, unsupported, queue_full"},
                       "message": {"type": "string"},
                       "field": {"type": ["string", "null"],
                                 "description": "dotted path of the offending request field"}}}},
}
IGNORED = ("other keys are ignored and named in the response's warnings; options.strict "
           "refuses them")


def _question(kind: str, criteria: dict, required: bool, description: str) -> dict:
    return {"type": "object", "title": kind, "required": ["type", "criteria"] if required
            else ["type"], "description": f"{description}; {IGNORED}",
            "properties": {
                "type": {"const": kind},
                "instructions": {"description": "any JSON value (a string is used raw); the "
                                 "question id when missing, null or \"\""},
                "criteria": criteria}}


QUESTION = {"oneOf": [
    _question("noul", {"type": ["object", "null"], "properties": {"true": {}, "false": {}}},
              False, "criteria: optional descriptions of the answers true and false"),
    _question("choice", {"type": "object", "minProperties": 1}, True,
              "criteria: option id -> description (any JSON value), reported in request order; "
              "options.strict: 2-255 options"),
    _question("score", {"type": "array", "minItems": 1}, True,
              "criteria: level descriptions, lowest first; options.strict: 2-10 levels"),
]}
QUESTIONS = {"type": "object", "additionalProperties": QUESTION, "minProperties": 1,
             "propertyNames": {"minLength": 1},
             "description": "question id -> question; order matters; options.strict: at most "
                            "64"}
OPTIONS = {"type": ["object", "null"], "description": IGNORED,
           "properties": {
               "truncate_state": {"type": "boolean", "default": False,
                                  "description": "cut an over-long state to fit instead of "
                                                 "answering 413"},
               "strict": {"type": "boolean", "default": False,
                          "description": "refuse what the reference ignores, apply the "
                                         "ecosystem's count limits"}}}
NO_MEDIA = {"type": ["array", "null"], "maxItems": 0,
            "description": "not supported (no vision tower): a non-empty list is refused"}
REQUEST = {
    "type": "object", "required": ["state", "questions"], "description": IGNORED,
    "properties": {"model": {"type": ["string", "null"], "description": "echoed back"},
                   "state": {"description": "any JSON value; a string is used raw"},
                   "questions": QUESTIONS, "options": OPTIONS,
                   "images": NO_MEDIA, "videos": NO_MEDIA,
                   "calibration": {"type": ["string", "null"],
                                   "description": "only \"none\" is available"}},
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
WARNINGS = {"type": "array", "description": "what was ignored", "items": {
    "type": "object", "required": ["code", "field", "message"],
    "properties": {"code": {"type": "string"}, "field": {"type": "string"},
                   "message": {"type": "string"}}}}
RESPONSE = {
    "type": "object", "required": ["model", "answers", "usage", "audit"],
    "properties": {"model": {"type": "string"}, "answers": ANSWERS, "usage": USAGE,
                   "audit": AUDIT, "truncated": {"type": "boolean"}, "warnings": WARNINGS},
}
BATCH_ENTRY = {"oneOf": [
    {"type": "string"},
    {"type": "object", "required": ["text"], "additionalProperties": False,
     "properties": {"id": {"type": "string"}, "text": {"description": "this input's state"},
                    "questions": QUESTIONS, "images": NO_MEDIA}},
]}


def batch_request(max_items: int) -> dict:
    """The two batch shapes; an input refused on its own is answered inside the results."""
    return {"oneOf": [
        {"type": "object", "required": ["state"], "title": "inputs sharing one question set",
         "additionalProperties": False,
         "properties": {"model": {"type": "string"},
                        "state": {"type": "array", "items": BATCH_ENTRY, "minItems": 1,
                                  "maxItems": max_items},
                        "questions": QUESTIONS, "options": OPTIONS,
                        "calibration": REQUEST["properties"]["calibration"]}},
        {"type": "object", "required": ["requests"], "title": "a list of full requests",
         "additionalProperties": False,
         "properties": {"model": {"type": "string",
                                  "description": "default for requests without"},
                        "requests": {"type": "array", "minItems": 1, "maxItems": max_items,
                                     "items": {**REQUEST, "properties": {
                                         **REQUEST["properties"], "id": {
                                             "type": "string",
                                             "description": "names its result"}}}}}},
    ]}


def single_or_batch(max_items: int) -> dict:
    """``/v1/systemone``: one request, or a batch (avrik-sdk posts its batches here)."""
    return {"anyOf": [REQUEST, batch_request(max_items)]}


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
ANSWER_OR_BATCH = {"anyOf": [RESPONSE, BATCH_RESPONSE]}
REQUEST_ID = {"X-Request-Id": {"description": "the request's X-Request-Id, or a new one",
                               "required": True, "schema": {"type": "string"}}}
RETRY_AFTER = {"description": "seconds", "schema": {"type": "string", "pattern": "^[0-9]+$"}}


def body(schema: dict) -> dict:
    """``openapi_extra`` for a route whose JSON body the handler parses itself."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def json_content(schema: dict, description: str, headers: dict | None = None) -> dict:
    out = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def errors(*statuses: int) -> dict:
    what = {400: "Content-Length is not a number", 401: "missing or wrong API key",
            413: "body over the limit, or too long for the window without "
                 "options.truncate_state",
            422: "invalid JSON or invalid request", 429: "queue full; see Retry-After",
            500: "a fault of the server (internal_error) or of the model (inference_error)",
            503: "model loading (see Retry-After), failed to load, or shutting down"}
    headers = {429: {**REQUEST_ID, "Retry-After": {**RETRY_AFTER, "required": True}},
               503: {**REQUEST_ID, "Retry-After": RETRY_AFTER}}
    return {s: json_content(ERROR, what[s], headers.get(s, REQUEST_ID)) for s in statuses}
