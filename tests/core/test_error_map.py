"""The error registry's two additions: ``errors.mapped`` (a table from foreign exception types to
ClefErrors) and the headers the server's refusals carry."""

from __future__ import annotations

import asyncio
import json

import pytest

from clef_gguf.core import errors
from clef_gguf.core.errors import CorruptModel, ModelNotFound

TABLE = {OSError: CorruptModel, ValueError: CorruptModel}


def test_a_mapped_error_becomes_the_clef_error_naming_field_and_file():
    with pytest.raises(CorruptModel) as caught:
        with errors.mapped(TABLE, field="tower", what="m.gguf is not a readable GGUF file"):
            raise ValueError("bad magic")
    assert caught.value.field == "tower"
    assert caught.value.message == "m.gguf is not a readable GGUF file: bad magic"
    assert isinstance(caught.value.__cause__, ValueError)  # the traceback keeps the original


def test_subclasses_are_mapped_and_the_most_specific_entry_wins():
    table = {Exception: CorruptModel, OSError: ModelNotFound}  # the broad entry first, on purpose
    with pytest.raises(ModelNotFound):
        with errors.mapped(table, field="head_weights", what="w"):
            raise FileNotFoundError("gone")
    with pytest.raises(CorruptModel):
        with errors.mapped(table, field="head_weights", what="w"):
            raise json.JSONDecodeError("Expecting value", "x", 0)


def test_an_unmapped_error_passes_unchanged():
    with pytest.raises(KeyError):
        with errors.mapped(TABLE, field="tower", what="w"):
            raise KeyError("k")


def test_clef_errors_interrupts_and_cancellations_are_never_mapped():
    table = {BaseException: CorruptModel}  # what the safetensors reader needs for Rust panics
    for raised in (errors.HeadMismatch("wrong head", field="head_config"), KeyboardInterrupt(),
                   SystemExit(3), asyncio.CancelledError()):
        with pytest.raises(type(raised)) as caught:
            with errors.mapped(table, field="tower", what="w"):
                raise raised
        assert caught.value is raised


def test_a_base_exception_is_mapped_when_the_table_asks():
    class Panic(BaseException):  # pyo3's PanicException derives from BaseException
        pass

    with pytest.raises(CorruptModel, match="w: the parser panicked"):
        with errors.mapped({BaseException: CorruptModel}, field="vision", what="w"):
            raise Panic("the parser panicked")


def test_the_message_is_the_first_line_or_the_type_name():
    with pytest.raises(CorruptModel) as caught:
        with errors.mapped(TABLE, field="tower", what="w"):
            raise ValueError("3 validation errors\n  field a\n  field b")
    assert caught.value.message == "w: 3 validation errors"
    with pytest.raises(CorruptModel) as caught:
        with errors.mapped(TABLE, field="tower", what="w"):
            raise ValueError()
    assert caught.value.message == "w: ValueError"


def test_nothing_raised_nothing_mapped():
    with errors.mapped(TABLE, field="tower", what="w"):
        value = 1
    assert value == 1


# ---------------------------------------------------------------- headers of the server's refusals
def test_refusals_carry_their_headers_and_bodies_stay_as_they_were():
    busy = errors.ServerBusy("64 requests are already waiting for the model; retry later", retry_after=7)
    assert (busy.code, busy.status, busy.headers, busy.retry_after) == ("queue_full", 429, {"Retry-After": "7"}, 7)
    stopping = errors.ServerShuttingDown("the server is shutting down")
    assert (stopping.code, stopping.status, stopping.headers) == ("shutting_down", 503, {"Retry-After": "1"})
    assert errors.ServerShuttingDown("drain timeout", retry_after=None).headers == {}
    key = errors.Unauthorized("missing or wrong API key")
    assert (key.code, key.status) == ("unauthorized", 401)
    assert key.headers == {"WWW-Authenticate": 'Bearer realm="clef-gguf"'}
    gone = errors.ClientClosed("the client disconnected")
    assert (gone.code, gone.status, gone.headers) == ("client_closed", 499, {})
    assert errors.ModelLoading("loading", retry_after=2).headers == {"Retry-After": "2"}
    assert errors.HttpRefusal(418, "teapot", headers={"X": "y"}).headers == {"X": "y"}
    assert errors.InvalidValue("no").headers == {}
    for error in (busy, stopping, key, gone):  # headers never reach the body
        assert error.to_dict() == {"error": {"code": error.code, "message": error.message, "field": None}}


def test_headers_are_per_instance():
    one, two = errors.InvalidValue("a"), errors.InvalidValue("b")
    one.headers["X"] = "1"
    assert two.headers == {}
