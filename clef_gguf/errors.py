"""Every error a user can cause, as a class with a stable ``code``.

The CLI prints ``{"error": {"code", "message", "field"}}`` and the server sends the same body
with ``status``; the code never changes once released, the message may be reworded.
"""

from __future__ import annotations


class ClefError(Exception):
    """Base class: ``code`` (stable), ``message`` (human), ``field`` (request path or None)."""

    code = "clef_error"
    status = 500

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def to_dict(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "field": self.field}}

    def __str__(self) -> str:
        where = f" (field: {self.field})" if self.field else ""
        return f"{self.code}: {self.message}{where}"


# Request problems (HTTP 422).
class InvalidRequest(ClefError):
    code = "invalid_request"
    status = 422


class InvalidJson(InvalidRequest):
    """The body is not one JSON document we can read unambiguously."""

    code = "invalid_json"


class MissingField(InvalidRequest):
    code = "missing_field"


class UnknownField(InvalidRequest):
    code = "unknown_field"


class InvalidValue(InvalidRequest):
    code = "invalid_value"


class InvalidQuestionType(InvalidRequest):
    code = "invalid_question_type"


class NoQuestions(InvalidRequest):
    code = "no_questions"


class TooManyQuestions(InvalidRequest):
    code = "too_many_questions"


class EmptyQuestionId(InvalidRequest):
    code = "empty_question_id"


class InvalidCriteria(InvalidRequest):
    code = "invalid_criteria"


class TooFewOptions(InvalidRequest):
    code = "too_few_options"


class TooManyOptions(InvalidRequest):
    code = "too_many_options"


class Unsupported(InvalidRequest):
    """Something valid in SystemOne that this runtime cannot do (images, calibration...)."""

    code = "unsupported"


# Length (HTTP 413): refused rather than silently truncated.
class ContextTooLarge(ClefError):
    code = "context_too_large"
    status = 413


# Model files (raised at load time).
class ModelLoadError(ClefError):
    code = "model_load_error"
    status = 500


class ModelNotFound(ModelLoadError):
    code = "model_not_found"


class CorruptModel(ModelLoadError):
    code = "corrupt_model"


class HeadMismatch(ModelLoadError):
    code = "head_mismatch"


class ConversionError(ClefError):
    code = "conversion_error"


class InferenceError(ClefError):
    code = "inference_error"
    status = 500


# Bulk jobs (clef-gguf batch): input and output files are the user's (422: exit 2).
class DuplicateId(ClefError):
    """Two records share an id: their answers could not be told apart, and resume would skip one."""

    code = "duplicate_id"
    status = 422


class InvalidInput(ClefError):
    """The input file cannot be read as JSONL or Parquet at all (not one bad record: the file)."""

    code = "invalid_input"
    status = 422


class CorruptOutput(ClefError):
    """An existing output file has a line or table that clef-gguf did not write."""

    code = "corrupt_output"
    status = 422


class InternalError(ClefError):
    """A fault in clef-gguf or llama.cpp on one record (not the record's): the others go on."""

    code = "internal_error"
    status = 500


class MissingDependency(ClefError):
    code = "missing_dependency"
    status = 500
