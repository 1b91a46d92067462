"""GGUF files, read hardened: gguf-py's reader stopped at the first byte past the end, the tensor
table checked where llama.cpp would abort, the qwen35 header checked where it would hang, and
every other failure of gguf-py a ``CorruptModel`` naming the field.

Also here: ggml's own dequantizer (for the types gguf-py has no numpy code for), and the ggml
types PyPI gguf lacks, added to gguf-py's enums by :func:`ensure_gguf_types`: only the reader
(and whoever asks for a type by name) applies that patch, never an import.
"""

from __future__ import annotations

import ctypes
import enum
import math
import threading
from pathlib import Path
from typing import Any, Literal, NoReturn

import gguf
import numpy as np
import numpy.typing as npt

from clef_gguf.core import errors
from clef_gguf.core.errors import CorruptModel, ModelNotFound

# The architectures clef-gguf reads: the language tower llama.cpp runs, and the native clef GGUF whose
# head is inside (``convert split`` turns one into the other).
TOWER_ARCH = "qwen35"
NATIVE_ARCH = "clef"

# gguf-py raises ValueError, struct.error, IndexError, KeyError, UnicodeDecodeError, OverflowError...
# on bad bytes, and no narrower list is known to be complete: any of them is a damaged file.
READ_ERRORS: dict[type[BaseException], type[errors.ClefError]] = {Exception: CorruptModel}


# Metadata arrays longer than this (the vocabulary's 248,320 tokens, their types and merges) are walked
# and checked but not read into gguf-py's per-item arrays unless asked for: one numpy array per item was
# ~1.7M Python objects for a Clef-Flash tower, ~0.5 GiB held while it parsed and seconds per load, for
# values that only `convert split` reads (llama.cpp and tokenizer.json have their own copies).
SKIM_ITEMS = 1024


def open_gguf(path: str | Path, field: str = "tower", *, whole_arrays: bool = False) -> gguf.GGUFReader:
    """Parse a GGUF's header and tensor table (mmap); a truncated or foreign file -> CorruptModel
    (``field``: which of the model's files it is). ``whole_arrays``: read every metadata array into
    gguf-py's fields (``ReaderField.contents``); else long ones are only located (:func:`array_length`,
    :func:`string_items`)."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFound(f"GGUF file not found: {path}", field=field)
    ensure_gguf_types()  # PyPI gguf lacks Q2_0: without this a Q2_0 file raises ValueError
    with errors.mapped(READ_ERRORS, field=field, what=f"{path} is not a readable GGUF file"):
        reader = (_Reader if whole_arrays else _SkimReader)(path, "r")
        _check_table(reader)
    return reader


def array_length(reader: gguf.GGUFReader, key: str) -> int | None:
    """Items of the metadata array ``key`` (None: no such key), read whole or not."""
    skimmed = getattr(reader, "skimmed", {}).get(key)
    if skimmed is not None:
        return len(skimmed[1])
    f = reader.fields.get(key)
    return None if f is None else len(f.data)


def string_items(reader: gguf.GGUFReader, key: str) -> list[bytes]:
    """The items of the string array ``key`` as bytes ([] where absent), read whole or not."""
    skimmed = getattr(reader, "skimmed", {}).get(key)
    if skimmed is not None:
        _, starts, end = skimmed
        view = memoryview(reader.data.data)  # items lie back to back: each ends where the next begins
        ends = [*starts[1:].tolist(), end]
        return [bytes(view[o + 8:e]) for o, e in zip(starts.tolist(), ends)]
    f = reader.fields.get(key)
    return [] if f is None else [bytes(f.parts[i]) for i in f.data]


class _Reader(gguf.GGUFReader):
    """gguf-py's reader, stopped at the first read past the end of the file. On its own it returns
    short arrays there, and walks a damaged array length or entry count one item at a time (for
    billions of steps on a large file)."""

    def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
             override_order: None | Literal["I", "S", "<"] = None) -> npt.NDArray[Any]:
        arr = super()._get(offset, dtype, count, override_order)
        if len(arr) != int(count):
            raise ValueError(f"the file ends inside the field at offset {int(offset)}")
        return arr

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[gguf.GGUFValueType]]:
        if raw_type == gguf.GGUFValueType.ARRAY:  # each item takes at least one byte
            n = int(self._get(orig_offs + 4, np.uint64)[0])
            if n > len(self.data) - orig_offs:
                raise ValueError(f"an array of {n} items at offset {orig_offs} overruns the file")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_fields(self, offs: int, count: int) -> int:
        if int(count) > len(self.data) // 13:  # a key/value entry takes at least 13 bytes
            raise ValueError(f"{int(count)} metadata entries cannot fit in the file")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[gguf.ReaderField]]:
        if int(count) > len(self.data) // 24:  # a tensor entry takes at least 24 bytes
            raise ValueError(f"{int(count)} tensor entries cannot fit in the file")
        return super()._build_tensor_info(offs, count)


class _SkimReader(_Reader):
    """:class:`_Reader` that only locates long metadata arrays (``SKIM_ITEMS``): each is walked (every
    string's length checked against the file's end), its field keeps no items, and ``skimmed[key]`` holds
    its item type, where each item starts and where the array ends."""

    def __init__(self, path: Path, mode: Literal["r"]) -> None:
        self.skimmed: dict[str, tuple[gguf.GGUFValueType, npt.NDArray[np.int64], int]] = {}
        self._key = ""
        super().__init__(path, mode)

    def _build_fields(self, offs: int, count: int) -> int:
        if int(count) > len(self.data) // 13:
            raise ValueError(f"{int(count)} metadata entries cannot fit in the file")
        for _ in range(int(count)):  # gguf-py's loop, knowing each field's key while its value is read
            orig_offs = offs
            klen, kdata = self._get_str(offs)
            self._key = str(bytes(kdata), encoding="utf-8")
            offs += int(klen.nbytes + kdata.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            parts: list[npt.NDArray[Any]] = [klen, kdata, raw_type]
            size, value_parts, idxs, types = self._get_field_parts(offs, int(raw_type[0]))
            self._push_field(gguf.ReaderField(orig_offs, self._key, parts + value_parts,
                                              [i + len(parts) for i in idxs], types), skip_sum=True)
            offs += size
        return offs

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[gguf.GGUFValueType]]:
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        n, itype = int(count[0]), gguf.GGUFValueType(int(raw_itype[0]))
        if n <= SKIM_ITEMS or itype == gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        if n > len(self.data) - orig_offs:
            raise ValueError(f"an array of {n} items at offset {orig_offs} overruns the file")
        offs, end = orig_offs + 12, len(self.data)
        if itype == gguf.GGUFValueType.STRING:
            starts = np.empty(n, dtype=np.int64)
            view = memoryview(self.data.data)
            for i in range(n):
                if offs + 8 > end:
                    raise ValueError(f"the file ends inside item {i} of {self._key}")
                starts[i] = offs
                offs += 8 + int.from_bytes(view[offs:offs + 8], "little")
            if offs > end:
                raise ValueError(f"the last item of {self._key} runs past the end of the file")
        else:
            width = np.dtype(self.gguf_scalar_to_np[itype]).itemsize
            starts = orig_offs + 12 + width * np.arange(n, dtype=np.int64)
            offs += width * n
            if offs > end:
                raise ValueError(f"{self._key}'s {n} items run past the end of the file")
        self.skimmed[self._key] = (itype, starts, offs)
        return offs - orig_offs, [raw_itype, count], [], [gguf.GGUFValueType.ARRAY, itype]


def _check_table(reader: gguf.GGUFReader) -> None:
    """What gguf-py lets through and llama.cpp may abort on: text metadata that is not UTF-8, and
    tensors that are not 1-4-D, have an empty dimension or more elements than int64 counts (gguf-py
    multiplies the dims in wrapping uint64), split a block, or whose data is misaligned or lies
    outside the file."""
    for f in reader.fields.values():
        if f.types == [gguf.GGUFValueType.STRING]:
            bytes(f.parts[-1]).decode("utf-8")
    for t in reader.tensors:
        dims = [int(d) for d in t.shape]
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if not 1 <= len(dims) <= 4 or min(dims) < 1 or math.prod(dims) >= 2**63 or dims[0] % block:
            raise ValueError(f"tensor {t.name} has an impossible {t.tensor_type.name} shape {dims}")
        end = t.data_offset + math.prod(dims) // block * type_size
        if (t.data_offset - reader.data_offset) % reader.alignment or end > len(reader.data):
            raise ValueError(f"tensor {t.name}'s data (offset {t.data_offset}, ending at {end}) is "
                             f"misaligned or past the end of the file ({len(reader.data)} bytes)")


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def file_type_name(reader: gguf.GGUFReader) -> str:
    """``general.file_type`` as a quant label (``q8_0``, ``q4_k_m``, ``f32``...)."""
    ft = field_value(reader, "general.file_type")
    if ft is None:
        return "unknown"
    try:
        name = gguf.LlamaFileType(int(ft)).name
    except ValueError:
        return f"ftype_{ft}"
    return name.replace("MOSTLY_", "").replace("ALL_", "").lower()


def second_scaled(reader: gguf.GGUFReader) -> list[str]:
    """The weights llama.cpp multiplies by a second, per-tensor scale (``<name>.scale``: NVFP4)."""
    names = {t.name for t in reader.tensors}
    return sorted(n for n in names if n.endswith(".weight") and n.removesuffix(".weight") + ".scale" in names)


# Written by `clef-gguf convert --keep-layers` (clef_gguf.convert.keep_layers): the decoder layers
# kept at a wider type than the quant's mix, as "0-7=q8_0".
KEEP_LAYERS_KEY = "clef_gguf.keep_layers"


def precision_label(reader: gguf.GGUFReader) -> str:
    """The audit's precision: ``file_type_name``, plus ``+keep[0-7=q8_0]`` for a tower whose
    layers were kept wider (every other tower's precision stays its file type)."""
    name = file_type_name(reader)
    kept = field_value(reader, KEEP_LAYERS_KEY)
    return f"{name}+keep[{kept}]" if isinstance(kept, str) and kept else name


# ---------------------------------------------------------------- qwen35 header checks
# qwen35 hyperparameters llama.cpp 0.3.36 reads but does not check against the tensors: a bad value
# reaches a GGML_ASSERT (the process aborts) or a graph that never finishes. Its layer limit:
LLAMA_MAX_LAYERS = 512
_INT_TYPES = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}


def check_header(reader: gguf.GGUFReader, path: Path) -> None:
    """Refuse (CorruptModel) a qwen35 GGUF, parsed by :func:`open_gguf`, that llama.cpp would
    abort or hang on: block count, width, rotary dims, GDN inner size, norm epsilon or vocab."""

    def refuse(why: str) -> NoReturn:
        raise CorruptModel(f"{path} is a damaged qwen35 tower: {why}", field="tower")

    def number(key: str, kinds: set[str] = _INT_TYPES, required: bool = True) -> Any:
        f = reader.fields.get(key)
        if f is None and not required:  # llama.cpp has a default for it
            return None
        if f is None or len(f.types) != 1 or f.types[0].name not in kinds:
            refuse(f"{key} is missing or not a {'whole ' if 'INT32' in kinds else ''}number")
        return f.contents()

    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    n_layer = number("qwen35.block_count")
    blocks = {int(n.split(".")[1]) for n in shapes if n.split(".")[0] == "blk"
              and n.split(".")[1].isdigit()}
    if not 1 <= n_layer <= LLAMA_MAX_LAYERS or blocks != set(range(n_layer)):
        refuse(f"qwen35.block_count is {n_layer}, the tensors have {len(blocks)} blocks")
    n_embd = number("qwen35.embedding_length")
    if shapes.get("token_embd.weight", [None])[0] != n_embd:
        refuse(f"qwen35.embedding_length {n_embd} is not token_embd.weight's width "
               f"{shapes.get('token_embd.weight')}")
    head = number("qwen35.attention.key_length", required=False)
    n_rot = number("qwen35.rope.dimension_count", required=False)
    n_rot = head if n_rot is None else n_rot  # llama.cpp's default
    if n_rot is not None and (n_rot < 2 or n_rot % 2 or (head is not None and n_rot > head)):
        refuse(f"qwen35.rope.dimension_count {n_rot} is not an even count <= key_length {head}")
    # Rotary pairs given to each of the (up to 4) position axes: at most the n_rot / 2 there are.
    sections = reader.fields.get("qwen35.rope.dimension_sections")
    if n_rot is not None and sections is not None and sections.types[-1].name in _INT_TYPES:
        values = sections.contents()
        values = [int(v) for v in values] if isinstance(values, list) else [int(values)]
        if len(values) > 4 or min(values, default=0) < 0 or sum(values) > n_rot // 2:
            refuse(f"qwen35.rope.dimension_sections {values} do not split {n_rot // 2} pairs")
    inner = number("qwen35.ssm.inner_size")
    wrong = [n for n, s in shapes.items() if n.endswith(".ssm_out.weight") and s[0] != inner]
    if inner < 1 or wrong:
        refuse(f"qwen35.ssm.inner_size {inner} is not the width of {wrong[:1] or 'ssm_out'}")
    eps = number("qwen35.attention.layer_norm_rms_epsilon", {"FLOAT32", "FLOAT64"})
    if not 0 < eps < 1:  # NaN fails too
        refuse(f"qwen35.attention.layer_norm_rms_epsilon is {eps}")
    tokens = string_items(reader, "tokenizer.ggml.tokens")  # llama.cpp asserts they are distinct
    if len(set(tokens)) < len(tokens):
        refuse("tokenizer.ggml.tokens holds the same token twice")


# ---------------------------------------------------------------- ggml's own dequantizer
class _TypeTraits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


def _libggml_base() -> ctypes.CDLL:
    # Already loaded by libllama; CDLL returns the same handle. Its directory is llama-cpp-python's.
    from llama_cpp import _ggml

    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        path = _ggml.libggml_base_path / name
        if path.exists():
            return ctypes.CDLL(str(path))
    raise CorruptModel(f"libggml-base not found in {_ggml.libggml_base_path}")


def _type_traits(type_id: int) -> _TypeTraits:
    """ggml's ``ggml_get_type_traits(type)``: name, block size, bytes per block, dequantizer."""
    lib = _libggml_base()
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib.ggml_get_type_traits(type_id).contents


def ggml_to_float(raw: np.ndarray, type_id: int, n_cols: int) -> np.ndarray:
    """Dequantize with ggml's routine, for types gguf-py has no numpy code for (Q1_0, Q2_0...)."""
    traits = _type_traits(type_id)
    if not traits.to_float:
        raise CorruptModel(f"ggml has no dequantizer for tensor type {type_id}")
    raw = np.ascontiguousarray(raw)
    out = np.empty((raw.shape[0], n_cols), dtype=np.float32)
    _TO_FLOAT(traits.to_float)(raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                               out.size)
    return out


# ---------------------------------------------------------------- ggml types PyPI gguf lacks
# llama-cpp-python 0.3.36's ggml has GGML_TYPE_Q2_0 = 42 (LLAMA_FTYPE_MOSTLY_Q2_0 = 41); PyPI gguf
# 0.19.0 does not, and GGUFReader raises ValueError on any file holding one such tensor. So we add
# the enum members, with (block size, bytes per block) taken from the ggml we run, so the reader
# slices rows exactly as llama.cpp does; their rows dequantize through ``ggml_to_float``. A newer
# gguf that knows these values is left untouched. Values from ggml.h / llama.h of that build:
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
    setattr(member, "__objclass__", cls)  # enum's private bookkeeping, which typeshed leaves out
    setattr(member, "_sort_order_", len(cls._member_names_))
    type.__setattr__(cls, name, member)  # EnumType.__setattr__ refuses to touch members
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)


def _ggml_sizes(type_id: int, name: str) -> tuple[int, int]:
    traits = _type_traits(type_id)
    found = (traits.type_name or b"").decode()
    if found.lower() != name.lower():  # another ggml numbering: do not guess
        raise RuntimeError(f"ggml type {type_id} is {found!r}, expected {name!r}")
    return int(traits.blck_size), int(traits.type_size)


def ensure_gguf_types() -> None:
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
