"""safetensors files, read so that every way one can be damaged is a ClefError naming the field and
the file, never the library's own exception (or a Rust panic) reaching the user.

Callers keep what is theirs to check (which names, which shapes, which dtypes): this module
opens the file, lists its header, and reads tensors or rows of one, optionally refusing NaN or
infinity. A missing file is ``ModelNotFound``; anything else is the caller's error class
(``CorruptModel`` by default, ``ConversionError`` for the converters).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from clef_gguf.core import errors
from clef_gguf.core.errors import ClefError, CorruptModel, ModelNotFound

ErrorClass = type[ClefError]


def failures(error: ErrorClass) -> dict[type[BaseException], ErrorClass]:
    """What reading a damaged file raises, each mapped to ``error`` (``errors.mapped``'s table)."""
    return dict.fromkeys((
        SafetensorError,  # the header: its length, JSON, dtypes, offsets; a file shorter than it says
        OSError,  # a directory, a file we may not read, a failed mmap
        ValueError,  # torch refusing what the header describes
        RuntimeError,
        IndexError,  # a row past the end of a table
        BaseException,  # pyo3's PanicException: a panic inside the Rust parser
    ), error)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # as safetensors names it: BF16, F32, U8, F8_E4M3...


def finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity (integer tensors have none)."""
    if not tensor.is_floating_point():
        return True
    # torch has no isfinite for float8_e4m3fn; widening keeps its NaNs.
    probe = tensor.float() if tensor.element_size() == 1 else tensor
    return bool(torch.isfinite(probe).all())


class Tensors:
    """One open safetensors file (see :func:`opened`): its header, its tensors."""

    def __init__(self, handle: Any, path: Path, field: str | None, error: ErrorClass,
                 unreadable: str) -> None:
        self._handle, self.path, self.field, self.error = handle, path, field, error
        with self._reading(unreadable):
            self._names: list[str] = list(handle.keys())
        self._known = set(self._names)

    def _reading(self, what: str) -> contextlib.AbstractContextManager[None]:
        return errors.mapped(failures(self.error), field=self.field, what=what)

    def _check(self, name: str) -> None:
        if name not in self._known:
            raise self.error(f"{self.path.name} has no tensor {name}", field=self.field)

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def info(self, name: str) -> TensorInfo:
        self._check(name)
        with self._reading(f"{self.path.name}: cannot read the header of {name}"):
            view = self._handle.get_slice(name)
            return TensorInfo(tuple(int(d) for d in view.get_shape()), str(view.get_dtype()))

    def header(self) -> dict[str, TensorInfo]:
        """Name -> shape and dtype of every tensor, in the file's order; no data is read."""
        return {name: self.info(name) for name in self._names}

    def tensor(self, name: str, *, check_finite: bool = False) -> torch.Tensor:
        """The tensor as stored; ``check_finite``: refuse one that holds NaN or infinity."""
        self._check(name)
        with self._reading(f"{self.path.name}: cannot read tensor {name}"):
            tensor: torch.Tensor = self._handle.get_tensor(name)
        if check_finite and not finite(tensor):
            raise self.error(f"{self.path.name}: tensor {name} contains NaN or infinity", field=self.field)
        return tensor

    def rows(self, name: str, ids: Sequence[int]) -> torch.Tensor:
        """Rows ``ids`` of a 2-D tensor, read one slice at a time (never the whole table)."""
        self._check(name)
        with self._reading(f"{self.path.name}: cannot read rows of {name}"):
            table = self._handle.get_slice(name)
            if not ids:
                return torch.empty((0, int(table.get_shape()[1])))
            return torch.stack([table[i:i + 1][0] for i in ids])


def _found(path: Path, field: str | None, kind: str) -> None:
    if not path.is_file():
        where = f"{path} is a directory" if path.is_dir() else str(path)
        raise ModelNotFound(f"{kind} not found: {where}", field=field)


@contextlib.contextmanager
def opened(path: str | Path, *, field: str | None, error: ErrorClass = CorruptModel,
           kind: str = "safetensors file", unreadable: str | None = None) -> Iterator[Tensors]:
    """The file open for reading, closed after the block. ``field``: what the errors blame;
    ``kind``: what the file is, for ModelNotFound ("head weights not found: ..."); ``unreadable``:
    the message that starts a damaged header's error (default "NAME is not a readable safetensors
    file")."""
    path = Path(path)
    _found(path, field, kind)
    unreadable = unreadable or f"{path.name} is not a readable safetensors file"
    with contextlib.ExitStack() as stack:
        with errors.mapped(failures(error), field=field, what=unreadable):
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
        yield Tensors(handle, path, field, error, unreadable)


def read_header(path: str | Path, *, field: str | None, error: ErrorClass = CorruptModel,
                kind: str = "safetensors file", unreadable: str | None = None) -> dict[str, TensorInfo]:
    """Name -> shape and dtype of every tensor of one file (:func:`opened`'s arguments)."""
    with opened(path, field=field, error=error, kind=kind, unreadable=unreadable) as tensors:
        return tensors.header()
