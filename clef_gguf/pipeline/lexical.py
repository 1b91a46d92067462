"""Lexical rows: lm_head rows of option-span tokens, read straight from the GGUF.

The head averages ``lm_head.weight[x_t]`` over each option's tokens (spec §4 B). We read only the
rows we need from the memory-mapped ``output.weight`` (``token_embd.weight`` only when the model
is tied and has no ``output.weight``), dequantize them to float32 and keep them in a store bounded
by bytes: the full vocab x hidden table would be ~4 GB in float32 for Clef-Flash.
"""

from __future__ import annotations

import threading
from typing import Protocol

import gguf
import numpy as np
import numpy.typing as npt

from clef_gguf.core.errors import CorruptModel
from clef_gguf.core.limits import MiB
from clef_gguf.formats.gguf import ggml_to_float


OUTPUT, TIED = "output.weight", "token_embd.weight"
# Dequantized rows kept: the device policy's lexical-row budget for Clef-Flash (models/catalog.json)
# holds 4,096 rows of the 9B's width, more than any request's options need.
CACHE_BYTES = 64 * MiB


class RowSource(Protocol):
    """Where lexical rows come from: an lm_head tensor of ``vocab_size`` rows of ``hidden_size``."""

    tensor_name: str
    hidden_size: int
    vocab_size: int

    @property
    def type_name(self) -> str:
        """The stored type of the rows (before dequantization), e.g. Q8_0 or BF16."""
        ...

    def dequantize(self, ids: np.ndarray) -> np.ndarray:
        """float32 ``[len(ids), hidden_size]``: the rows of these token ids, in order."""
        ...


class GGUFRows:
    """The rows of a GGUF's ``output.weight`` (``token_embd.weight`` when tied), memory-mapped."""

    def __init__(self, reader: gguf.GGUFReader):
        tensors = {t.name: t for t in reader.tensors}
        tensor = tensors.get(OUTPUT) or tensors.get(TIED)
        if tensor is None:
            raise CorruptModel(f"{reader.data.filename if hasattr(reader.data, 'filename') else 'GGUF'}"
                               f" has neither {OUTPUT} nor {TIED}", field="tower")
        if len(tensor.shape) != 2:  # rows of hidden_size values, one per token
            raise CorruptModel(f"{tensor.name} has shape {[int(d) for d in tensor.shape]}, "
                               "not [hidden, vocab]", field="tower")
        self.tensor_name = tensor.name
        self.type = gguf.GGMLQuantizationType(tensor.tensor_type)
        self._data = tensor.data
        self.hidden_size, self.vocab_size = (int(x) for x in tensor.shape[:2])  # ggml order: [H, vocab]

    @property
    def type_name(self) -> str:
        return self.type.name

    def dequantize(self, ids: np.ndarray) -> np.ndarray:
        raw = np.asarray(self._data[ids])
        if self.type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return raw.astype(np.float32).reshape(len(ids), self.hidden_size)
        try:
            rows = gguf.quants.dequantize(raw, self.type)
        except NotImplementedError:
            rows = ggml_to_float(raw, int(self.type), self.hidden_size)
        return np.asarray(rows, dtype=np.float32).reshape(len(ids), self.hidden_size)


class RowStore:
    """``rows(token_ids) -> float32 [n, H]``: a source's rows, dequantized, in a bounded store
    (thread-safe).

    The store holds at most ``max_bytes`` of rows (least recently used evicted), so a client
    cycling through the vocabulary cannot grow it past the device policy's budget. Lookups are
    array operations (a token -> slot table and one gather), not a Python loop per token.
    """

    def __init__(self, source: RowSource, max_bytes: int = CACHE_BYTES):
        self.source = source
        self.tensor_name = source.tensor_name
        self.hidden_size, self.vocab_size = source.hidden_size, source.vocab_size
        self.capacity = int(max(1, min(self.vocab_size, max_bytes // (4 * self.hidden_size))))
        self._store: npt.NDArray[np.float32] = np.empty((self.capacity, self.hidden_size), dtype=np.float32)
        self._slot: npt.NDArray[np.int64] = np.full(self.vocab_size, -1, dtype=np.int64)  # token -> slot, -1: absent
        self._owner: npt.NDArray[np.int64] = np.full(self.capacity, -1, dtype=np.int64)  # slot -> token id
        self._used: npt.NDArray[np.int64] = np.zeros(self.capacity, dtype=np.int64)  # slot -> tick of last use
        self._tick = 0
        self._lock = threading.Lock()

    @property
    def type_name(self) -> str:
        """The stored type of the rows (before dequantization), e.g. Q8_0 or BF16."""
        return self.source.type_name

    @property
    def cached(self) -> np.ndarray:
        """Token ids whose rows are in the store."""
        return np.sort(self._owner[self._owner >= 0])

    def _admit(self, missing: np.ndarray, keep: np.ndarray) -> None:
        """Put ``missing`` rows in the slots least recently used, never in those of ``keep``."""
        used = self._used.copy()
        used[keep] = np.iinfo(np.int64).max
        slots = np.argpartition(used, missing.size - 1)[:missing.size]
        evicted = self._owner[slots]
        self._slot[evicted[evicted >= 0]] = -1
        self._store[slots] = self.source.dequantize(missing)
        self._owner[slots] = missing
        self._slot[missing] = slots

    def rows(self, token_ids: np.ndarray) -> np.ndarray:
        token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if token_ids.size == 0:
            return np.zeros((0, self.hidden_size), dtype=np.float32)
        bad = token_ids[(token_ids < 0) | (token_ids >= self.vocab_size)]
        if bad.size:
            raise CorruptModel(f"token id {int(bad[0])} is outside {self.tensor_name} "
                               f"({self.vocab_size} rows)")
        unique = np.unique(token_ids)
        if unique.size > self.capacity:  # more distinct rows than the store holds: no caching
            return self.source.dequantize(unique)[np.searchsorted(unique, token_ids)]
        with self._lock:
            self._tick += 1
            slots = self._slot[unique]
            missing = unique[slots < 0]
            if missing.size:
                self._admit(missing, slots[slots >= 0])
            slots = self._slot[token_ids]
            self._used[slots] = self._tick
            return self._store[slots]


class LexicalRows(RowStore):
    """A GGUF's lexical rows (:class:`GGUFRows`) in the bounded store."""

    def __init__(self, reader: gguf.GGUFReader, max_bytes: int = CACHE_BYTES):
        super().__init__(GGUFRows(reader), max_bytes)
