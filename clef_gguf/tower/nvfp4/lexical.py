"""Lexical rows of an NVFP4 checkpoint: option-token rows of its high-precision ``lm_head``.

The recipes keep ``lm_head`` in bf16 because the head averages its rows as option vectors; we
read only the rows a request needs, through the same bounded store as the GGUF path.
"""

from __future__ import annotations

import numpy as np

from clef_gguf.core.errors import CorruptModel
from clef_gguf.pipeline.lexical import CACHE_BYTES, RowStore
from clef_gguf.tower.nvfp4.checkpoint import Checkpoint


class CheckpointSource:
    """The rows of a checkpoint's ``lm_head.weight`` (torch order: ``[vocab, hidden]``)."""

    def __init__(self, checkpoint: Checkpoint):
        self.tensor_name = checkpoint.lm_head
        shape = checkpoint.shape(self.tensor_name)
        if len(shape) != 2:
            raise CorruptModel(f"{self.tensor_name} has shape {shape}, not [vocab, hidden]",
                               field="tower")
        if self.tensor_name.endswith(".weight_packed"):
            raise CorruptModel("lm_head is NVFP4-quantized: the head needs its rows in high "
                               "precision", field="tower")
        self._checkpoint = checkpoint
        self._dtype = checkpoint.dtype(self.tensor_name)
        self.vocab_size, self.hidden_size = int(shape[0]), int(shape[1])

    @property
    def type_name(self) -> str:
        return self._dtype

    def dequantize(self, ids: np.ndarray) -> np.ndarray:
        rows = self._checkpoint.rows(self.tensor_name, [int(i) for i in ids])
        return rows.float().numpy().reshape(len(ids), self.hidden_size)


class CheckpointRows(RowStore):
    """``rows(token_ids) -> float32 [n, H]`` read from the checkpoint's ``lm_head.weight``."""

    def __init__(self, checkpoint: Checkpoint, max_bytes: int = CACHE_BYTES):
        super().__init__(CheckpointSource(checkpoint), max_bytes)
