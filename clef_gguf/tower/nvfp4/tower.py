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
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from clef_gguf.core.cpus import available_cpus, check_threads, set_torch_threads
from clef_gguf.core.limits import CONTEXT_WINDOW, GiB
from clef_gguf.core.errors import ClefError, InvalidSetting
from clef_gguf.pipeline.mediaprompt import MediaPrompt
from clef_gguf.tower.nvfp4.checkpoint import Checkpoint
from clef_gguf.tower.nvfp4 import linear_kernels
from clef_gguf.tower.nvfp4.kernels import kernel_name
from clef_gguf.tower.nvfp4.model import TextModel
from clef_gguf.tower.cache import StateCache, usable
from clef_gguf.tower.packing import host_free_memory
from clef_gguf.tower.protocol import Forwarded, Prompt, check_pack
from clef_gguf.tower.schedule import Schedule

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicCache

log = logging.getLogger("clef_gguf.tower.nvfp4")
# Compute dtype per device: fp32 on the CPU (the reference's numerics; bf16 matmuls are slow
# there), bf16 on CUDA (what the checkpoints' own runtime uses).
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}
# The share of the device's free memory the dense copies of every quantized layer may take; over it,
# each call dequantizes its layer (one dense weight at a time: the small-GPU path).
DENSE_SHARE = 0.5
# what ``nvfp4_dtype`` may ask for instead (fp32 on CUDA: like-for-like checks against the CPU)
COMPUTE_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}
# Prompts per forward (``forward_many``'s policy): on CUDA a forward of one prompt leaves most of the
# card idle, so fresh prompts of up to PACK_MAX_TOKENS share one, at most PACK_TOKENS padded tokens
# in all (what a 9B forward's activations take in bf16: ~1.5 GiB). Not yet measured on a GPU: the
# GPU check's nvfp4 row times it. On the CPU this backend is the slow reference path: one at a time.
PACK = {"cpu": 1, "cuda": 16}
PACK_MAX_TOKENS = 2048
PACK_TOKENS = 16384
# On a CPU a K-quant GGUF is the fast path (~110M: Q4_K_M 1.7x faster than this backend, 3.6x faster than
# this checkpoint as an NVFP4 GGUF, whose llama.cpp CPU kernel is slower still: docs/nvfp4.md)
CPU_WARNING = ("the nvfp4 backend is running on the CPU (no CUDA device): PyTorch's reference code for "
               "the linear attention, slow next to a GGUF K-quant (clef-flash:Q4_K_M), the fast CPU path")


@dataclass(frozen=True)
class _CacheCopy:
    """A transformers cache kept in the state cache; ``nbytes`` is what the budget counts."""

    cache: DynamicCache
    nbytes: int


def free_bytes(device: torch.device) -> int:
    """Free memory where the weights live: the CUDA device's, or the host's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_free_memory(False)


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

    def decode_many(self, prompts: list[np.ndarray]) -> list[np.ndarray]:
        """Hidden states of several prompts decoded from scratch together (``TextModel.hidden_many``)."""
        hidden = self.model.hidden_many([torch.from_numpy(ids.astype(np.int64)) for ids in prompts])
        return [h.float().cpu().numpy() for h in hidden]

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


def packs(prompts: list[tuple[int, np.ndarray]], size: int) -> list[list[tuple[int, np.ndarray]]]:
    """``prompts`` in forwards of up to ``size`` prompts and :data:`PACK_TOKENS` padded tokens,
    by length (least padding)."""
    groups: list[list[tuple[int, np.ndarray]]] = []
    for item in sorted(prompts, key=lambda p: len(p[1])):
        group = groups[-1] if groups else None
        # sorted by length: this prompt is the longest of the group it joins
        if group is None or len(group) >= size or (len(group) + 1) * len(item[1]) > PACK_TOKENS:
            groups.append([item])
        else:
            group.append(item)
    return groups


class NVFP4Tower:
    """The tower in PyTorch on an NVFP4 checkpoint's weights (``protocol.LanguageTower``)."""

    def __init__(self, checkpoint: Checkpoint, model: TextModel, n_ctx: int, threads: int,
                 dense: bool = False) -> None:
        self.checkpoint, self.model = checkpoint, model
        self.path = checkpoint.directory
        self._threads = threads
        self._lock = threading.Lock()
        self._seqs = CacheSequences(model, n_ctx)
        self._schedule: Schedule[DynamicCache, _CacheCopy] = Schedule(self._seqs, self._lock)
        self.kernel = kernel_name(model.device, checkpoint.scheme.activations, dense=dense)
        self.linear_kernels = linear_kernels.bound(model.modeling)

    @classmethod
    def load(cls, config_path: str | Path, *, n_ctx: int = CONTEXT_WINDOW, threads: int | None = None,
             gpu_layers: int | str = "auto", dtype: str = "auto") -> NVFP4Tower:
        """``dtype``: the compute dtype, bf16 or fp32; auto: ``DTYPES`` (bf16 on CUDA, fp32 on the CPU)."""
        check_threads(threads)
        device = pick_device(gpu_layers)
        if dtype not in COMPUTE_DTYPES:
            raise InvalidSetting(f"nvfp4_dtype must be one of {', '.join(COMPUTE_DTYPES)} (got {dtype!r})",
                                 field="nvfp4_dtype")
        checkpoint = Checkpoint(config_path)
        threads = threads or available_cpus()
        set_torch_threads(threads)
        model = TextModel(checkpoint, device=device, dtype=COMPUTE_DTYPES[dtype] or DTYPES[device.type])
        need, free = model.dense_bytes(), free_bytes(device)
        dense = 0 < need <= DENSE_SHARE * free
        if dense:
            model.materialize()
        log.info("nvfp4 weights %s: %.2f GiB dense against %.2f GiB free on %s",
                 "dequantized once at load" if dense else "dequantized at each call", need / GiB, free / GiB, device)
        tower = cls(checkpoint, model, n_ctx, threads, dense=dense)
        log.info(linear_kernels.describe(tower.linear_kernels))
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
    def cuda_device(self) -> int | None:
        device = self.model.device
        return (device.index or 0) if device.type == "cuda" else None

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
        return {"kernel": self.kernel, "device": self.device, "dtype": str(self.model.dtype).removeprefix("torch."),
                "linear_kernels": linear_kernels.describe(self.linear_kernels)}

    def pack_size(self, n_tokens: int) -> int:
        """How many prompts of ``n_tokens`` :data:`PACK` decodes in one forward on this device."""
        return PACK[self.model.device.type] if n_tokens <= PACK_MAX_TOKENS else 1

    def forward(self, ids: np.ndarray, prefix: int, state: int,
                cache: StateCache | None = None, media: MediaPrompt | None = None) -> Forwarded:
        """``(hidden [T, n_embd], cached_tokens)`` of a prompt ``[prefix][state][rest]`` (token
        counts) on the canonical schedule; ``media``: its images and videos, as embeddings."""
        return self._schedule.forward(ids, prefix, state, cache, media)

    def keep_points(self, ids: np.ndarray, prefix: int, points: list[int], cache: StateCache | None,
                    media: MediaPrompt | None = None) -> int:
        """Snapshots of ``ids[:point]`` for each point, on the canonical schedule (``Schedule.keep_points``)."""
        return self._schedule.keep_points(ids, prefix, points, cache, media)

    def forward_many(self, prompts: list[Prompt], cache: StateCache | None = None, *,
                     pack: int | None = None) -> list[Forwarded | ClefError]:
        """``forward`` for each prompt, in order, a prompt's ClefError in its place.

        Up to ``pack`` prompts (None: :meth:`pack_size`'s policy) that the cache cannot serve are
        decoded whole, from scratch, in one forward (:func:`packs`); their hidden states agree with
        ``forward``'s segmented schedule to float rounding, and their whole prompts are cached (not
        their ``[prefix][state]``). A prompt seen before, one whose ``[prefix][state]`` is cached, and
        a second copy of a prompt in the same call run one at a time, restoring what is cached."""
        check_pack(pack)
        cache = usable(cache)
        schedule = self._schedule
        results: list[Forwarded | ClefError | None] = [None] * len(prompts)
        with self._lock:
            packable: list[tuple[int, np.ndarray]] = []
            alone: list[tuple[int, np.ndarray, int, int]] = []
            claimed: set[bytes] = set()
            for i, (ids, prefix, state) in enumerate(prompts):
                try:
                    ids = schedule.check(ids)
                except ClefError as exc:
                    results[i] = exc
                    continue
                want = self.pack_size(len(ids)) if pack is None else pack
                fresh = (want > 1 and ids.tobytes() not in claimed and schedule.cached_prompt(ids, cache) is None
                         and not schedule.state_cached(ids, prefix, state, cache))
                if fresh:
                    claimed.add(ids.tobytes())
                    packable.append((i, ids))
                else:
                    alone.append((i, ids, prefix, state))
            size = PACK[self.model.device.type] if pack is None else pack
            for group in packs(packable, size):
                if len(group) == 1:  # alone, on the canonical schedule (its states kept)
                    i, ids = group[0]
                    alone.append((i, ids, prompts[i][1], prompts[i][2]))
                    continue
                try:
                    hidden = self._seqs.decode_many([ids for _, ids in group])
                except torch.OutOfMemoryError:  # the pack does not fit beside the weights: one at a time
                    log.warning("nvfp4: %d prompts (%d tokens) in one forward ran out of %s memory; decoding "
                                "them one at a time", len(group), sum(len(ids) for _, ids in group),
                                self.model.device)
                    if self.model.device.type == "cuda":
                        torch.cuda.empty_cache()
                    alone.extend((i, ids, prompts[i][1], prompts[i][2]) for i, ids in group)
                    continue
                for (i, ids), h in zip(group, hidden):
                    schedule.remember(ids, h, cache)
                    results[i] = (h, 0)
            for i, ids, prefix, state in alone:
                results[i] = schedule.forward_held(ids, prefix, state, cache)
        return cast("list[Forwarded | ClefError]", results)  # every prompt has its result now

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
