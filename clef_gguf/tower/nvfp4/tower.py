"""The NVFP4 tower: the same ``forward(ids, prefix, state, cache)`` as the llama.cpp tower.

Prompts are decoded on the same canonical schedule (a ``tower.schedule.Schedule`` over this
backend's :class:`CacheSequences`), ``[prefix][state][rest]`` each as its own segment continuing
one cache, so a restored prefix or state (a copy of the transformers cache: KV cells, conv and
recurrent states) gives bit-identical hidden states to a fresh decode.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np
import torch

from clef_gguf.core.cpus import available_cpus, check_threads, set_torch_threads
from clef_gguf.core.limits import CONTEXT_WINDOW
from clef_gguf.core.errors import ClefError, InvalidSetting
from clef_gguf.pipeline.mediaprompt import MediaPrompt
from clef_gguf.tower.nvfp4.checkpoint import Checkpoint
from clef_gguf.tower.nvfp4.kernels import kernel_name
from clef_gguf.tower.nvfp4.model import TextModel
from clef_gguf.tower.cache import StateCache
from clef_gguf.tower.protocol import Forwarded, Prompt, check_pack
from clef_gguf.tower.schedule import Schedule

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicCache

log = logging.getLogger("clef_gguf.tower.nvfp4")
# Compute dtype per device: fp32 on the CPU (the reference's numerics; bf16 matmuls are slow
# there), bf16 on CUDA (what the checkpoints' own runtime uses).
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}
CPU_WARNING = ("the nvfp4 backend is running on the CPU (no CUDA device): weights are dequantized "
               "layer by layer at every call, which is slow; a GGUF quant is the fast CPU path")


@dataclass(frozen=True)
class _CacheCopy:
    """A transformers cache kept in the state cache; ``nbytes`` is what the budget counts."""

    cache: DynamicCache
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


class CacheSequences:
    """The NVFP4 backend's :class:`~clef_gguf.tower.schedule.Sequences`: a sequence is a
    transformers cache, kept as a deep copy; ``closed`` is the tower's (set by its ``close``)."""

    vocab_name = "vocab"

    def __init__(self, model: TextModel, n_ctx: int) -> None:
        self.model, self.n_ctx, self.closed = model, n_ctx, False

    @property
    def n_embd(self) -> int:
        return self.model.hidden_size

    @property
    def n_vocab(self) -> int:
        return self.model.vocab_size

    def decode(self, ids: np.ndarray, cache: DynamicCache | None, past: int,
               media: MediaPrompt | None = None) -> np.ndarray:
        """Hidden states of ``ids`` (tokens ``past``... of the prompt) after what ``cache`` holds
        (None: no cache at all, one whole decode)."""
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

    def begin(self) -> DynamicCache:
        return self.model.new_cache()

    def resume(self, kept: _CacheCopy) -> DynamicCache:
        return self.model.copy_cache(kept.cache)

    def append(self, seq: DynamicCache, ids: np.ndarray, start: int, media: MediaPrompt | None = None) -> np.ndarray:
        return self.decode(ids, seq, start, media)

    def kept_bytes(self, seq: DynamicCache) -> int:
        return self.model.cache_bytes(seq)

    def keep(self, seq: DynamicCache, size: int) -> _CacheCopy:
        return _CacheCopy(self.model.copy_cache(seq), size)


class NVFP4Tower:
    """The tower in PyTorch on an NVFP4 checkpoint's weights (``protocol.LanguageTower``)."""

    def __init__(self, checkpoint: Checkpoint, model: TextModel, n_ctx: int, threads: int) -> None:
        self.checkpoint, self.model = checkpoint, model
        self.path = checkpoint.directory
        self._threads = threads
        self._lock = threading.Lock()
        self._seqs = CacheSequences(model, n_ctx)
        self._schedule: Schedule[DynamicCache, _CacheCopy] = Schedule(self._seqs, self._lock)
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
        return self._seqs.n_embd

    @property
    def n_vocab(self) -> int:
        return self._seqs.n_vocab

    @property
    def n_ctx(self) -> int:
        return self._seqs.n_ctx

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
        return self._seqs.closed

    def details(self) -> dict[str, str]:
        return {"kernel": self.kernel, "device": self.device}

    def pack_size(self, n_tokens: int) -> int:
        """1: this tower decodes one prompt at a time."""
        return 1

    def forward(self, ids: np.ndarray, prefix: int, state: int,
                cache: StateCache | None = None, media: MediaPrompt | None = None) -> Forwarded:
        """``(hidden [T, n_embd], cached_tokens)`` of a prompt ``[prefix][state][rest]`` (token
        counts) on the canonical schedule; ``media``: its images and videos, as embeddings."""
        return self._schedule.forward(ids, prefix, state, cache, media)

    def forward_many(self, prompts: list[Prompt], cache: StateCache | None = None, *,
                     pack: int | None = None) -> list[Forwarded | ClefError]:
        """``forward`` for each prompt in turn (``pack`` is checked; every prompt runs alone)."""
        check_pack(pack)
        return self._schedule.forward_each(prompts, cache)

    def hidden_states(self, ids: np.ndarray) -> np.ndarray:
        """Hidden states of one prompt decoded from scratch, as one segment (no reuse)."""
        with self._lock:
            return self._seqs.decode(self._schedule.check(ids), None, 0)

    def close(self) -> None:
        with self._lock:  # the weights go with the last reference; later calls get a clear error
            self._seqs.closed, self._schedule.prefix = True, None

    def __enter__(self) -> NVFP4Tower:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
