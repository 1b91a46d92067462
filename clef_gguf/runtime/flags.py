"""The load flags every command that loads a model shares, and reading a request from a file.

The flags are generated from ``settings.LoadSettings`` (one typed object: field types, bounds and
help text in one place); ``load_model`` turns the parsed flags back into settings and loads them.
Their own module so that command modules (``serve``, ``bench``, ``parity``...) need not import back
into ``clef_gguf.cli``, which imports them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from clef_gguf.core import errors
from clef_gguf.runtime.registry import Models
from clef_gguf.runtime.settings import LoadSettings


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model-selection flags shared by every command that loads a model."""
    LoadSettings.add_arguments(p)


def load_model(args: argparse.Namespace) -> Models:
    """The models the parsed flags name."""
    from clef_gguf.runtime.model import Clef  # torch + llama.cpp only once a command loads

    return Clef.from_settings(LoadSettings.from_args(args))


def read_request(source: str) -> Any:
    try:
        raw = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except OSError as exc:
        raise errors.InvalidValue(f"cannot read the request: {exc.strerror}: {source}",
                                  field="request") from None
    from clef_gguf.pipeline.request import parse_json  # pydantic: only for the commands that read one

    return parse_json(raw)
