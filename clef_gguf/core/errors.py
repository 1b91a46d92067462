"""Every error a user can cause, as a class with a stable ``code``.

The CLI prints ``{"error": {"code", "message", "field"}}`` and the server sends the same body
with ``status`` and ``headers``; the code never changes once released, the message may be reworded.
:func:`mapped` turns another library's exceptions into these, by a table.
Past 400 lines because every code has its one home here, in one registry.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping


class ClefError(Exception):
    """Base class: ``code`` (stable), ``message`` (human), ``field`` (request path or None), and the
    ``headers`` the server sends with it (``Retry-After``, ``WWW-Authenticate``...)."""

    code = "clef_error"
    status = 500

    def __init__(self, message: str, field: str | None = None, *,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.headers: dict[str, str] = dict(headers or {})

    @property
    def exit_code(self) -> int:
        """The CLI's exit status: 2 for what the caller sent (a request, a flag), 1 for the rest."""
        return 2 if self.status in (404, 413, 422) or isinstance(self, InvalidSetting) else 1

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


# Images and videos (clef_gguf/media): the field names the image, e.g. "images.1" or "videos.0.2".
class UnsupportedMediaSource(InvalidRequest):
    """A local path or URL that this process was not allowed to read (server without an allow-list)."""

    code = "unsupported_media_source"


class InvalidMedia(InvalidRequest):
    """Bytes that are not one image we decode: corrupt, truncated, unknown format, no frames, ratio > 200."""

    code = "invalid_media"


# Length (HTTP 413): refused rather than silently truncated.
class ContextTooLarge(ClefError):
    code = "context_too_large"
    status = 413


class MediaTooLarge(ClefError):
    """An image past the pixel budget or Pillow's decompression-bomb limit, or too many images."""

    code = "media_too_large"
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


class AdapterMismatch(ModelLoadError):
    """A fine-tune that does not fit the tower it is loaded on (another base, size or architecture),
    or an adapter file llama.cpp cannot read."""

    code = "adapter_mismatch"


class PinMismatch(ModelLoadError):
    """The Hub no longer serves what a source's first pull pinned: main moved, or a file changed."""

    code = "pin_mismatch"


class NoQuantFits(ModelLoadError):
    """No quant of the family fits this machine's memory (the message says what would)."""

    code = "no_quant_fits"


class ConversionError(ClefError):
    code = "conversion_error"


class ProbeFailed(ClefError):
    """``pick``'s speed probe measured nothing: its process failed (the message keeps its last
    words). The machine's or the build's problem, not a value the user gave."""

    code = "probe_failed"
    status = 500


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


# Configuration (raised at load time): a ``Clef.load`` setting that cannot work (``threads``,
# ``gpu_layers``, ``precision``, ``backend``...). The operator's fault, not a request's: the server
# reports it through /health and exits; the CLI exits 2, as for any bad flag.
class CacheNotWritable(ClefError):
    """What a command measured could not be kept in its cache under ``$HF_HOME/clef-gguf``."""

    code = "cache_not_writable"


class AddressUnavailable(ClefError):
    """A server's address cannot be bound: another process listens there, or the address is not this
    machine's."""

    code = "address_unavailable"


class InvalidSetting(ClefError):
    code = "invalid_setting"
    status = 500


# Server refusals (``clef-gguf serve``): the HTTP layer's own, around the request refusals above.
class InvalidBatch(InvalidRequest):
    """A batch body without a non-empty list of inputs."""

    code = "invalid_batch"


class TooManyInputs(InvalidRequest):
    """More inputs in one batch than ``--max-batch``."""

    code = "too_many_inputs"


class InvalidContentLength(ClefError):
    code = "invalid_content_length"
    status = 400


class UnknownModel(ClefError):
    """A request's ``model`` names none of the models (base and fine-tunes) this process serves."""

    code = "unknown_model"
    status = 404


class Unauthorized(ClefError):
    """A missing or wrong API key; the challenge tells the client which scheme to use."""

    code = "unauthorized"
    status = 401

    def __init__(self, message: str, field: str | None = None, *, realm: str = "clef-gguf") -> None:
        super().__init__(message, field, headers={"WWW-Authenticate": f'Bearer realm="{realm}"'})


class HostNotAllowed(ClefError):
    """The ``Host`` a request names is not one this server answers to (DNS rebinding's trace)."""

    code = "host_not_allowed"
    status = 421


class OriginNotAllowed(ClefError):
    """A browser request from a page on another origin (or a refused CORS preflight)."""

    code = "origin_not_allowed"
    status = 403


class UnsupportedMediaType(ClefError):
    """A browser sent a body that is not ``application/json`` (a form, ``text/plain``)."""

    code = "unsupported_media_type"
    status = 415


class NotFound(ClefError):
    code = "not_found"
    status = 404


class MethodNotAllowed(ClefError):
    code = "method_not_allowed"
    status = 405


class HttpRefusal(ClefError):
    """Any other refusal of the HTTP framework: its status, and the code ``http_<status>``."""

    code = "http_<status>"
    status = 400

    def __init__(self, status: int, message: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message, headers=headers)
        self.status, self.code = status, f"http_{status}"


class BodyTooLarge(ClefError):
    code = "body_too_large"
    status = 413


def _retry_after(seconds: int | None) -> dict[str, str]:
    return {} if seconds is None else {"Retry-After": str(seconds)}


class ServerBusy(ClefError):
    """Every place in the tokenizer stage or the model's queue is taken: retry after
    ``retry_after`` seconds (the ``Retry-After`` header; avrik-sdk backs off on it)."""

    code = "queue_full"
    status = 429

    def __init__(self, message: str, field: str | None = None, *, retry_after: int = 1) -> None:
        super().__init__(message, field, headers=_retry_after(retry_after))
        self.retry_after = retry_after


class ClientClosed(ClefError):
    """The client disconnected before its answer: nothing is sent; logged as 499 (nginx's)."""

    code = "client_closed"
    status = 499


class ModelLoading(ClefError):
    code = "model_loading"
    status = 503

    def __init__(self, message: str, field: str | None = None, *, retry_after: int | None = None) -> None:
        super().__init__(message, field, headers=_retry_after(retry_after))


class ModelUnavailable(ClefError):
    """The served model failed to load."""

    code = "model_unavailable"
    status = 503


class ServerShuttingDown(ClefError):
    """The server stopped before this request ran. ``retry_after=None``: no ``Retry-After`` (what a
    request cut off by the drain timeout is told)."""

    code = "shutting_down"
    status = 503

    def __init__(self, message: str, field: str | None = None, *, retry_after: int | None = 1) -> None:
        super().__init__(message, field, headers=_retry_after(retry_after))


class NotComputed(ClefError):
    """A batch input that was accepted but never ran (its client left mid-batch)."""

    code = "not_computed"
    status = 500


# Evaluation and calibration (``clef-gguf eval`` / ``calibrate``, ``Clef.load(calibration=)``).
class InvalidLabel(InvalidRequest):
    """A record's label that is none of its question's options, or names no question."""

    code = "invalid_label"


class CalibrationMismatch(ModelLoadError):
    """A calibration file fitted on other weights, template or head than the model loaded."""

    code = "calibration_mismatch"


class WrongCalibration(InvalidRequest):
    """A request whose ``calibration`` names another version than the one the model applies."""

    code = "wrong_calibration"


class CorruptCalibration(ModelLoadError):
    """A calibration file that cannot be read, or whose content no longer matches its version."""

    code = "corrupt_calibration"


class CalibrationNotBetter(ClefError):
    """The fitted temperatures make the held-out records worse: no file is written."""

    code = "calibration_not_better"
    status = 422


# ---------------------------------------------------------------- foreign exceptions
# Never turned into another error: ours already name their field, and an interrupt or a
# cancellation is the user's or the event loop's, not the file's.
_PASSING: tuple[type[BaseException], ...] = (ClefError, KeyboardInterrupt, SystemExit, GeneratorExit)


def _passes(exc: BaseException) -> bool:
    if isinstance(exc, _PASSING):
        return True
    asyncio = sys.modules.get("asyncio")  # no CancelledError can exist before asyncio is imported
    return asyncio is not None and isinstance(exc, asyncio.CancelledError)


@contextlib.contextmanager
def mapped(table: Mapping[type[BaseException], type[ClefError]], *, field: str | None,
           what: object) -> Iterator[None]:
    """Raise what the block raises as the ClefError ``table`` maps its type to, with ``field`` and
    the message ``"{what}: {the foreign message's first line}"``; an exception the table does not
    map passes unchanged.

    The entry for the exception's most specific class wins, whatever the table's order: in
    ``{Exception: CorruptModel, OSError: ModelNotFound}`` an OSError is ModelNotFound.
    ``BaseException`` may be mapped (pyo3's PanicException, a Rust panic in a parser, derives from
    it): interrupts, exits, cancellations and ClefErrors are never mapped.
    """
    try:
        yield
    except BaseException as exc:
        kind = None if _passes(exc) else next((table[c] for c in type(exc).__mro__ if c in table), None)
        if kind is None:
            raise
        # The first line only: the message goes in one JSON field, and pydantic's run to a page.
        detail = next(iter(str(exc).strip().splitlines()), "") or type(exc).__name__
        raise kind(f"{what}: {detail}", field=field) from exc
