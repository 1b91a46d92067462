"""What a language tower gives the pipeline, whichever backend runs it.

The llama.cpp tower (:class:`clef_gguf.tower.llama_tower.Tower`) and the NVFP4 tower
(:class:`clef_gguf.tower.nvfp4.tower.NVFP4Tower`) both implement :class:`LanguageTower`; ``Clef``, the
server and the bulk runners are typed against it and call every member directly.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

from clef_gguf.core.errors import InvalidValue

if TYPE_CHECKING:
    import numpy as np

    from clef_gguf.core.errors import ClefError
    from clef_gguf.pipeline.mediaprompt import MediaPrompt
    from clef_gguf.tower.cache import StateCache

# One prompt for ``forward_many``: (token ids, prefix tokens, state tokens).
Prompt: TypeAlias = tuple["np.ndarray", int, int]
# A prompt's ``(hidden [T, n_embd] float32, cached_tokens)``.
Forwarded: TypeAlias = tuple["np.ndarray", int]


def check_pack(pack: Any) -> None:
    """``pack`` is None (the tower's policy) or a whole number >= 1."""
    if pack is not None and (not isinstance(pack, int) or isinstance(pack, bool) or pack < 1):
        raise InvalidValue(f"pack must be a whole number >= 1 (got {pack!r})", field="pack")


@runtime_checkable
class LanguageTower(Protocol):
    """Final hidden states of every prompt token, on the canonical decode schedule
    (``tower.schedule.Schedule``, which each tower owns): the same states whether a segment is
    decoded or restored."""

    path: Path

    @property
    def n_embd(self) -> int: ...

    @property
    def n_vocab(self) -> int: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def threads(self) -> int: ...

    @property
    def gpu_layers(self) -> int:
        """Layers offloaded to a GPU (-1: all, 0: the CPU)."""
        ...

    @property
    def cuda_device(self) -> int | None:
        """The CUDA device index that holds the tower's layers (where ``head_device=auto`` puts the
        head), None when they are on the CPU."""
        ...

    @property
    def uses_nextn(self) -> bool:
        """Whether the lm_head is kept off the prompt (only option rows are ever read)."""
        ...

    @property
    def closed(self) -> bool: ...

    def details(self) -> dict[str, str]:
        """What ``Clef.info`` reports about this backend beyond the common keys."""
        ...

    def forward(self, ids: np.ndarray, prefix: int, state: int,
                cache: StateCache | None = None, media: MediaPrompt | None = None) -> Forwarded:
        """``(hidden, cached_tokens)`` of a prompt ``[prefix][state][rest]`` (token counts);
        ``media``: its images and videos, decoded as embeddings at their M-RoPE positions."""
        ...

    def keep_points(self, ids: np.ndarray, prefix: int, points: list[int], cache: StateCache | None,
                    media: MediaPrompt | None = None) -> int:
        """Decode ``ids`` up to the last of ``points`` (token counts), keeping a snapshot in
        ``cache`` at each, for prompts that share ``ids[:point]``; the tokens decoded."""
        ...

    def forward_many(self, prompts: list[Prompt], cache: StateCache | None = None, *,
                     pack: int | None = None) -> list[Forwarded | ClefError]:
        """``forward`` for each prompt, in order; a prompt's ClefError in its place (the others
        still run). ``pack``: prompts decoded together (None: the tower's policy)."""
        ...

    def pack_size(self, n_tokens: int) -> int:
        """How many prompts of ``n_tokens`` the policy decodes together (1: one at a time)."""
        ...

    def hidden_states(self, ids: np.ndarray) -> np.ndarray:
        """Hidden states of one prompt decoded from scratch, as one segment (no reuse)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> LanguageTower: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...
