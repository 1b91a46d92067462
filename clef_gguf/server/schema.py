"""The wire contract as pydantic models: ``/openapi.json`` is generated from them, batch bodies are
validated by them, and the contract test checks every endpoint's real responses against them.

A single request is ``clef_gguf.pipeline.wire.SystemOneRequest``, the one model the parser validates
with and this document shows; the batch bodies here wrap it.

Response models forbid keys they do not name: a key added to a response without its model here
fails the contract test instead of drifting out of the document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Discriminator, Field, PlainValidator, Tag

from clef_gguf.core.questions import TYPES, Part, QuestionType
from clef_gguf.pipeline.wire import Images, Options, Questions, SystemOneRequest, literal

def _as_is(value: Any) -> Any:
    return value


# ---------------------------------------------------------------- errors
class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="stable (clef_gguf.core.errors), e.g. invalid_value, "
                                  "context_too_large, unsupported, queue_full")
    message: str
    field: str | None = Field(description="dotted path of the offending request field")


class ErrorBody(BaseModel):
    """Every refusal: a 4xx/5xx status with this body."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


# Batch fields passed on as sent, each documented as what it holds: ``clef_gguf.pipeline.request``
# validates them (and names their errors) when their input is prepared, so that a batch input
# fails alone and with the same error as a single request.
AnyId = Annotated[Any, PlainValidator(_as_is, json_schema_input_type=str)]
AnyQuestions = Annotated[Any, PlainValidator(_as_is, json_schema_input_type=Questions)]
AnyMedia = Annotated[Any, PlainValidator(_as_is, json_schema_input_type=Images)]
AnyOptions = Annotated[Any, PlainValidator(_as_is, json_schema_input_type=Options | None)]


# ---------------------------------------------------------------- batch bodies
class BatchEntry(BaseModel):
    """One input of avrik-sdk's batch shape."""

    model_config = ConfigDict(extra="forbid")

    id: AnyId = Field(None, description="names its result (default: the input's index)")
    text: Any = Field(description="this input's state")
    questions: AnyQuestions = Field(None, description="this input's own question set "
                                                        "(default: the batch's)")
    images: AnyMedia = None


AnyEntry = Annotated[Any, PlainValidator(_as_is, json_schema_input_type=str | BatchEntry)]


class InputsBatch(BaseModel):
    """Inputs sharing one question set (avrik-sdk's shape: it posts it to /v1/systemone)."""

    model_config = ConfigDict(extra="forbid", title="inputs sharing one question set")

    model: str | None = None
    state: list[AnyEntry] = Field(
        min_length=1, description="a string is an input whose id is its index")
    questions: AnyQuestions = None
    options: AnyOptions = None
    calibration: Any = Field(None, description="as in a single request")
    evidence: Any = Field(None, description="as in a single request: every input's answers with evidence")


class BatchRequest(SystemOneRequest):
    """A full request inside a batch; ``id`` names its result (default: its index)."""

    id: AnyId = Field(None, description="names its result")


AnyRequest = Annotated[Any, PlainValidator(_as_is, json_schema_input_type=BatchRequest)]


class RequestsBatch(BaseModel):
    model_config = ConfigDict(extra="forbid", title="a list of full requests")

    model: str | None = Field(None, description="default for requests without")
    requests: list[AnyRequest] = Field(min_length=1)


def _batch_shape(body: Any) -> str:
    return "requests" if isinstance(body, dict) and "requests" in body else "inputs"


BatchBody = Annotated[
    Annotated[InputsBatch, Tag("inputs")] | Annotated[RequestsBatch, Tag("requests")],
    Discriminator(_batch_shape),
    Field(description="an input refused on its own is answered inside the results")]
SingleOrBatch = SystemOneRequest | BatchBody
BATCH_LISTS = {"InputsBatch": "state", "RequestsBatch": "requests"}  # model -> its inputs


# ---------------------------------------------------------------- responses
# Each registered type's answer model (NoulAnswer, ChoiceAnswer, ...), generated from its entry in
# ``core.questions``: one field per key of its answer, typed by the part it holds.
PART_FIELDS: dict[Part, tuple[Any, dict[str, Any]]] = {
    Part.FIRST: (float, {"ge": 0, "le": 1}), Part.WINNER: (str, {}), Part.EXPECTED_LEVEL: (float, {}),
    Part.CONFIDENCE: (float, {"ge": 0, "le": 1}), Part.LEGEND: (dict[str, Any], {}),
    Part.PROBABILITIES: (dict[str, float], {}),
}


def _answer_model(entry: QuestionType) -> type[BaseModel]:
    fields: dict[str, Any] = {"type": (literal(entry.name), ...)}
    for item in entry.answer:
        annotation, bounds = PART_FIELDS[item.part]
        fields[item.key] = (annotation, Field(description=item.description, **bounds))
    return pydantic.create_model(f"{entry.name.capitalize()}Answer", __config__=ConfigDict(extra="forbid"),
                                 **fields)


ANSWER_MODELS = tuple(_answer_model(entry) for entry in TYPES)
Answer: Any = Annotated[Union[ANSWER_MODELS], Field(discriminator="type")]
Answers = Annotated[dict[str, Answer], Field(description="question id -> answer, in request "
                                                         "order")]


class BatchUsage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_tokens: int
    output_tokens: int


class Usage(BatchUsage):
    cached_tokens: int = Field(description="prompt tokens restored from the state cache instead "
                                           "of decoded")
    cached_media_tokens: int | None = Field(None, ge=1, description=(
        "image and video tokens the vision tower did not run for (restored with a cached state, or "
        "from the vision cache); only when there are some"))


# The opt-in evidence block (docs/evidence.md); its inner layout is documented there, not fixed here.
EVIDENCE = "where the head looked in the state, per question; only where the request asked for evidence"


class Audit(BaseModel):
    """What produced the answers; the lists hold one entry per answered input."""

    model_config = ConfigDict(extra="forbid")

    model_hash: str
    calibration_version: str
    prompt_template_sha256: list[str]
    allowed_token_set_hash: list[str]
    input_tokens: list[int]
    backend: str
    precision: str
    evidence: str | None = Field(None, description="the evidence mode, where the request asked for evidence")


class IgnoredKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str
    field: str
    message: str


class SystemOneResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    answers: Answers
    usage: Usage
    audit: Audit
    truncated: bool = Field(False, description="the state was cut to fit (options.truncate_state)")
    warnings: list[IgnoredKey] = Field(default_factory=list, description="what was ignored")
    evidence: dict[str, Any] | None = Field(None, description=EVIDENCE)


class AnsweredInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    answers: Answers
    truncated: bool = False
    model: str | None = Field(None, description="the model that answered this input, where the batch "
                              "mixes fine-tunes (each request's own \"model\")")
    model_hash: str | None = Field(None, description="that model's audit.model_hash, where the batch "
                                   "mixes fine-tunes")
    evidence: dict[str, Any] | None = Field(None, description=EVIDENCE)


class RefusedInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    error: ErrorDetail


class BatchResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    results: list[AnsweredInput | RefusedInput] = Field(description="in input order")
    usage: BatchUsage
    audit: Audit


class ModelEntry(BaseModel):
    """A served model (the base or a fine-tune): its name and what ``Clef.info`` says about it."""

    model_config = ConfigDict(extra="allow")

    name: str
    quant: str | None = None
    revision: str | None = None
    files: dict[str, str | None] | None = Field(None, description="file name -> sha256")


class Limits(BaseModel):
    """What this server refuses past: the page checks a request against them before sending it."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(description="larger bodies get 413 body_too_large (--max-body-bytes)")
    max_images: int = Field(description="pictures (images and video frames) one request may decode")


class ModelList(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelEntry]
    limits: Limits


class HealthOk(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: Literal["ok"]
    model: str | None
    model_hash: str | None
    backend: str | None
    precision: str | None
    gpu_layers: int | None = Field(description="the tower's layers on a GPU (0: all on the CPU)")
    head_device: str | None = Field(description="where the joint head runs: cpu, cuda, cuda:1...")


class HealthLoading(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: Literal["loading"]


class HealthFailed(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: Literal["error"]
    error: ErrorDetail


# ---------------------------------------------------------------- Workers AI's envelope
class WorkersAiError(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: int = Field(description="Workers AI's kind of refusal: 5006 bad input, 5007 no such "
                                  "model, 5021 over the context window, 3040 busy or loading, "
                                  "3043 internal, 10000 authentication, 10001 refused origin/host")
    message: str
    field: str | None = Field(None, description="dotted path of the offending request field")


class WorkersAiAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    result: SystemOneResponse
    success: Literal[True]
    errors: list[WorkersAiError] = Field(max_length=0)
    messages: list[Any] = Field(max_length=0)


class WorkersAiRefusal(BaseModel):
    model_config = ConfigDict(extra="forbid")

    result: None
    success: Literal[False]
    errors: list[WorkersAiError] = Field(min_length=1, max_length=1)
    messages: list[Any] = Field(max_length=0)


# ---------------------------------------------------------------- OpenAPI pieces
REQUEST_ID: dict[str, Any] = {"X-Request-Id": {"description": "the request's X-Request-Id, or a new one",
                               "required": True, "schema": {"type": "string"}}}
RETRY_AFTER: dict[str, Any] = {"description": "seconds", "schema": {"type": "string", "pattern": "^[0-9]+$"}}
WHY = {400: "Content-Length is not a number", 401: "missing or wrong API key",
       404: "a model name this server does not serve (unknown_model, under --strict)",
       403: "a browser request from another page's origin (origin_not_allowed)",
       415: "a browser request whose body is not application/json (unsupported_media_type)",
       421: "a Host this server does not answer to (host_not_allowed)",
       413: "body over the limit, or too long for the window without options.truncate_state",
       422: "invalid JSON or invalid request", 429: "queue full; see Retry-After",
       500: "a fault of the server (internal_error) or of the model (inference_error)",
       503: "model loading (see Retry-After), failed to load, or shutting down"}


def answer(model: Any, description: str,
           headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """A FastAPI ``responses`` entry: its schema generated from ``model``."""
    return {"model": model, "description": description,
            "headers": REQUEST_ID if headers is None else headers}


def refusals(*statuses: int, body: Any = ErrorBody) -> dict[int | str, dict[str, Any]]:
    headers: dict[int, dict[str, Any]] = {429: {**REQUEST_ID, "Retry-After": {**RETRY_AFTER, "required": True}},
               503: {**REQUEST_ID, "Retry-After": RETRY_AFTER}}
    return {s: answer(body, WHY[s], headers.get(s)) for s in statuses}


# Route path -> the request body it documents (the routes read the bytes themselves).
REQUEST_BODIES = {"/v1/systemone": SingleOrBatch, "/v1/systemone/batch": BatchBody,
                  "/client/v4/accounts/{account_id}/ai/run/{model}": SystemOneRequest}


def add_request_bodies(document: dict, bodies: dict[str, Any], max_batch: int) -> dict:
    """Put each POST route's request body schema, generated by pydantic, into the OpenAPI
    document FastAPI generated (it documents only bodies it parses itself). Batch lists get the
    server's ``maxItems``."""
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for path, body in bodies.items():
        generated = pydantic.TypeAdapter(body).json_schema(
            ref_template="#/components/schemas/{model}")
        for name, definition in generated.pop("$defs", {}).items():
            if name in BATCH_LISTS:
                definition["properties"][BATCH_LISTS[name]]["maxItems"] = max_batch
            components[name] = definition
        document["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": generated}}}
    return document
