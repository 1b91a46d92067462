"""The batch job's own refusals, with stable codes like every ``ClefError``.

Input and output problems count as the user's (HTTP-like status 422: the CLI exits 2); a missing
package is the environment's (exit 1).
"""

from __future__ import annotations

from clef_gguf.errors import ClefError


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


def need(module: str, extra: str):
    """Import an optional dependency or say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependency(f"{module} is not installed: pip install 'clef-gguf[{extra}]'",
                                field=None) from None
