"""What the tower can reuse instead of decoding again, under one byte budget.

- the **prefix**: llama.cpp's sequence state after the fixed 36-token system prefix, and its hidden
  states; decoded once per loaded model, kept outside the budget (tens of KiB to ~50 MiB for the 9B);
- **states**: the sequence state (recurrent state + KV cells) after ``[prefix][state]`` and the
  hidden states of those tokens, keyed by their token ids, so that another question set about the
  same document decodes only its schema;
- **prompts**: the hidden states of a whole prompt, so that a repeated request skips the tower.

Reuse never changes an answer: the tower decodes every prompt on one fixed schedule (each segment
in chunks from its own start), so a restored segment is bit-identical to a freshly decoded one. That
schedule, with every cache key and rule, is ``clef_gguf.tower.schedule``'s: this module only holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from clef_gguf.core.limits import MiB
from clef_gguf.core.lru import ByteLRU

if TYPE_CHECKING:  # numpy is only handled here, never needed to import this module
    import numpy as np

# About three 2,000-token states of the 9B (~150 MB each: 64 MB of KV cells, 50 MB of recurrent
# state, 32 MB of hidden states), or hundreds of short ones.
DEFAULT_MB = 512


class Kept(Protocol):
    """What a backend keeps of a sequence to restore it later; its size is what the budget counts."""

    @property
    def nbytes(self) -> int: ...


K = TypeVar("K", bound=Kept)


@dataclass(frozen=True)
class Snapshot(Generic[K]):
    """A sequence state that can be restored, and the hidden states of the tokens it covers."""

    n_tokens: int
    # llama.cpp's serialized sequence (uint8), or the NVFP4 tower's copy of its cache; None: prompt entry
    seq_state: K | None
    hidden: np.ndarray  # float32 [n_tokens, n_embd]

    @property
    def nbytes(self) -> int:
        return self.hidden.nbytes + (0 if self.seq_state is None else self.seq_state.nbytes)


class StateCache(ByteLRU[Snapshot[Any]]):
    """A byte-bounded LRU of snapshots; ``max_bytes=0`` keeps nothing (every prompt decoded)."""

    def __init__(self, max_bytes: int = DEFAULT_MB * MiB):
        super().__init__(max_bytes, lambda snapshot: snapshot.nbytes)

    @staticmethod
    def key(kind: str, ids: np.ndarray, tag: str = "") -> bytes:
        """``tag`` names what else the cached states depend on (a fine-tune's adapter): towers that
        share a cache under different tags never see each other's entries."""
        return f"{kind}{tag}:".encode() + ids.astype("<i4", copy=False).tobytes()


def usable(cache: StateCache | None) -> StateCache | None:
    """``cache``, or None where it keeps nothing."""
    return cache if cache is not None and cache.max_bytes > 0 else None
