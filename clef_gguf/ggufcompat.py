"""Teach PyPI ``gguf`` the ggml types it lags behind on, before anything parses a GGUF.

Why: llama-cpp-python 0.3.36's ggml has ``GGML_TYPE_Q2_0 = 42`` (and ``LLAMA_FTYPE_MOSTLY_Q2_0 =
41``), but PyPI ``gguf`` 0.19.0 does not: ``GGUFReader`` calls ``GGMLQuantizationType(42)`` on
every tensor and raises ``ValueError``, so a Q2_0 file (or any file with one Q2_0 tensor, e.g. a
forced ``output.weight``) could not even be opened (llama-cpp-notes.md §5). The copy of gguf-py
vendored in llama.cpp has the value, but it is not what ``pip install gguf`` gives.

The fix adds the missing enum members and their ``(block size, bytes per block)`` to
``gguf.GGML_QUANT_SIZES``, taking the sizes from ggml's own type traits of the library we run, so
the reader slices rows exactly as llama.cpp does. Dequantizing such rows is left to ggml's
``to_float`` (``lexical._ggml_to_float``): gguf-py has no numpy code for Q1_0/Q2_0 either way.
Newer ``gguf`` releases that know these values are left untouched.
"""

from __future__ import annotations

import enum
import threading

import gguf

# ggml type id -> gguf-py member name, and llama ftype -> LlamaFileType member name, that gguf
# 0.19.0 lacks (values from the vendored ggml/include/ggml.h and include/llama.h).
MISSING_TYPES = {42: "Q2_0"}
MISSING_FTYPES = {41: "MOSTLY_Q2_0"}

_done = False
_lock = threading.Lock()


def _add_member(cls: type[enum.IntEnum], name: str, value: int) -> None:
    """Add ``name = value`` to an existing IntEnum (what ``aenum.extend_enum`` does)."""
    if value in cls._value2member_map_ or name in cls._member_map_:
        return
    member = int.__new__(cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = cls
    member._sort_order_ = len(cls._member_names_)
    type.__setattr__(cls, name, member)  # EnumType.__setattr__ refuses to touch members
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)


def _ggml_sizes(type_id: int, name: str) -> tuple[int, int]:
    import ctypes

    from clef_gguf.lexical import _libggml_base, _TypeTraits

    lib = _libggml_base()
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    traits = lib.ggml_get_type_traits(type_id).contents
    found = (traits.type_name or b"").decode()
    if found.lower() != name.lower():  # another ggml numbering: do not guess
        raise RuntimeError(f"ggml type {type_id} is {found!r}, expected {name!r}")
    return int(traits.blck_size), int(traits.type_size)


def ensure() -> None:
    """Idempotent; cheap after the first call. Failures leave gguf as it was."""
    global _done
    if _done:
        return
    with _lock:
        if _done:
            return
        for value, name in MISSING_TYPES.items():
            if value in gguf.GGMLQuantizationType._value2member_map_:
                continue
            try:
                sizes = _ggml_sizes(value, name)
            except (RuntimeError, OSError, ImportError):
                continue  # the file then fails to open with gguf's own clear ValueError
            _add_member(gguf.GGMLQuantizationType, name, value)
            gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(value)] = sizes
        for value, name in MISSING_FTYPES.items():
            _add_member(gguf.LlamaFileType, name, value)
        _done = True
