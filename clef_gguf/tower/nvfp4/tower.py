"""The NVFP4 tower: the same ``forward(ids, prefix, state, cache)`` as the llama.cpp tower.

Prompts are decoded on the same canonical schedule, ``[prefix][state][rest]`` each as its own
segment continuing one cache, so a restored prefix or state (a copy of the transformers cache:
KV cells, conv and recurrent states) gives bit-identical hidden states to a fresh decode.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from clef_gguf.core.cpus import available_cpus, check_threads, set_torch_threads
from clef_gguf.core.limits import CONTEXT_WINDOW
from clef_gguf.core.errors import ClefError, InvalidSetting
from clef_gguf.pipeline.mediaprompt import MediaPrompt
from clef_gguf.tower.nvfp4.checkpoint import Checkpoint
from clef_gguf.tower.nvfp4.kernels import kernel_name
from clef_gguf.tower.nvfp4.model import TextModel
from clef_gguf.tower.cache import SegmentedForward, Snapshot, StateCache
from clef_gguf.tower.protocol import Forwarded, Prompt, check_pack

log = logging.getLogger("clef_gguf.tower.nvfp4")
# Compute dtype per device: fp32 on the CPU (the reference's numerics; bf16 matmuls are slow
# there), bf16 on CUDA (what the checkpoints' own runtime uses).
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}
CPU_WARNING = ("the nvfp4 backend is running on the CPU (no CUDA device): weights are dequantized "
               "layer by layer at every call, which is slow; a GGUF quant is the fast CPU path")


@dataclass(frozen=True)
class _CacheCopy:
    """A transformers cache kept in the state cache; ``nbytes`` is what the budget counts."""

    cache: Any
    nbytes: int


def pick_device(gpu_layers: int | str) -> torch.device:
    """``auto``/``all``/-1: CUDA when there is one; 0: the CPU. A partial count cannot be done:
    this tower is not split between devices."""
    if gpu_layers in (0, "0"):
        return torch.device("cpu")
    if gpu_layers not in ("auto", "all", -1, None):
        raise InvalidSetting(f"the nvfp4 backend places the whole tower on one device: gpu_layers "
                             f"must be auto, all or 0 (got {gpu_layers!r})", field="gpu_layers")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class NVFP4Tower(SegmentedForward):
    """The tower in PyTorch on an NVFP4 checkpoint's weights (``towers.LanguageTower``)."""

    def __init__(self, checkpoint: Checkpoint, model: TextModel, n_ctx: int, threads: int):
        self.checkpoint, self.model = checkpoint, model
        self.path = checkpoint.directory
        self._n_ctx, self._threads = n_ctx, threads
        self._lock = threading.Lock()
        self._prefix: tuple[bytes, Snapshot] | None = None
        self._closed = False
        self.kernel = kernel_name(model.device, checkpoint.scheme.activations)

    @classmethod
    def load(cls, config_path: str | Path, *, n_ctx: int = CONTEXT_WINDOW, threads: int | None = None,
             gpu_layers: int | str = "auto") -> NVFP4Tower:
        check_threads(threads)
        device = pick_device(gpu_layers)
        checkpoint = Checkpoint(config_path)
        threads = threads or available_cpus()
        set_torch_threads(threads)
        model = TextModel(checkpoint, device=device, dtype=DTYPES[device.type])
        tower = cls(checkpoint, model, n_ctx, threads)
        if device.type == "cpu":
            log.warning(CPU_WARNING)
        log.info("nvfp4 tower (%s) on %s: %s", checkpoint.scheme.name, device, tower.kernel)
        return tower

    @property
    def n_embd(self) -> int:
        return self.model.hidden_size

    @property
    def n_vocab(self) -> int:
        return self.model.vocab_size

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def threads(self) -> int:
        return self._threads

    @property
    def gpu_layers(self) -> int:
        return -1 if self.model.device.type == "cuda" else 0

    @property
    def uses_nextn(self) -> bool:
        return True  # lm_head is never run over the prompt: only option rows are read

    @property
    def device(self) -> str:
        return str(self.model.device)

    @property
    def closed(self) -> bool:
        return self._closed

    def details(self) -> dict[str, str]:
        return {"kernel": self.kernel, "device": self.device}

    def pack_size(self, n_tokens: int) -> int:
        """1: this tower decodes one prompt at a time."""
        return 1

    def forward_many(self, prompts: list[Prompt], cache: StateCache | None = None, *,
                     pack: int | None = None) -> list[Forwarded | ClefError]:
        """``forward`` for each prompt in turn (``pack`` is checked; every prompt runs alone)."""
        check_pack(pack)
        return self._forward_each(prompts, cache)

    def _decode(self, ids: np.ndarray, cache: Any, past: int, media: MediaPrompt | None = None) -> np.ndarray:
        if len(ids) == 0:
            return np.empty((0, self.n_embd), dtype=np.float32)
        runs, mrope = None, None
        if media is not None:  # the vision tower's rows in place of the pad tokens, M-RoPE positions
            end = past + len(ids)
            runs = [(begin - past, stop - past, torch.from_numpy(media.embed()[row:row + stop - begin]))
                    for begin, stop, row in media.pieces(past, end) if row is not None]
            mrope = torch.from_numpy(media.positions[:, past:end].astype(np.int64))
        hidden = self.model.hidden(torch.from_numpy(ids.astype(np.int64)), cache, past, runs, mrope)
        return hidden.float().cpu().numpy()

    def hidden_states(self, ids: np.ndarray) -> np.ndarray:
        """Hidden states of one prompt decoded from scratch, as one segment (no reuse)."""
        with self._lock:
            return self._decode(self._checked(ids), None, 0)

    # The sequence operations of the shared schedule (statecache.SegmentedForward): a sequence
    # is a transformers cache, kept as a deep copy.
    def _begin(self) -> Any:
        return self.model.new_cache()

    def _resume(self, kept: _CacheCopy) -> Any:
        return self.model.copy_cache(kept.cache)

    def _append(self, seq: Any, ids: np.ndarray, start: int, media: MediaPrompt | None = None) -> np.ndarray:
        return self._decode(ids, seq, start, media)

    def _kept_bytes(self, seq: Any) -> int:
        return self.model.cache_bytes(seq)

    def _keep(self, seq: Any, size: int) -> _CacheCopy:
        return _CacheCopy(self.model.copy_cache(seq), size)

    def close(self) -> None:
        with self._lock:  # the weights go with the last reference; later calls get a clear error
            self._closed, self._prefix = True, None

    def __enter__(self) -> NVFP4Tower:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
