"""Fine-tunes on a loaded base: a LoRA adapter applied by llama.cpp at run time plus a retrained head.

A fine-tune directory (``clef-gguf convert adapter``) holds the adapter GGUF, the head and the base's
head config. Loading one adds a model to a ``Clef`` that shares everything
with the base (the tower's weights, contexts and lock, the lexical rows, the tokenizer, the state
cache) except the adapter, the head and the cache keys (``Tower.adapted``): each extra fine-tune
costs its adapter and its head, nothing else.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from clef_gguf.pipeline import answer
from clef_gguf.core import errors
from clef_gguf.formats import calibration
from clef_gguf.formats.files import sha256_file
from clef_gguf.formats.finetune_files import AdapterFiles
from clef_gguf.formats.gguf import TOWER_ARCH
from clef_gguf.runtime.settings import Adapters

if TYPE_CHECKING:
    from clef_gguf.tower.llama_tower import Tower
    from clef_gguf.tower.protocol import LanguageTower



# What the adapter GGUF's header must say (llama.cpp's loader checks the same, in its log only).
ADAPTER_GGUF_KEYS = {"general.type": "adapter", "adapter.type": "lora", "general.architecture": TOWER_ARCH}


def named(adapters: Adapters | None) -> tuple[dict[str, AdapterFiles], bool]:
    """``({name: its files}, whether the one fine-tune answers by default)``. A bare directory is
    named by its manifest and answers by default; a mapping keeps the base as the default."""
    if adapters is None:
        return {}, False
    if isinstance(adapters, (str, Path)):
        one = AdapterFiles.from_directory(adapters)
        return {one.name: one}, True
    if not isinstance(adapters, Mapping):
        raise errors.InvalidSetting("adapters must be a fine-tune directory or a mapping of names to "
                                    f"directories (got {type(adapters).__name__})", field="adapters")
    for name in adapters:
        if not isinstance(name, str) or not name.strip() or "=" in name:
            raise errors.InvalidSetting(f"a fine-tune's name must be a non-empty string without '=' "
                                        f"(got {name!r})", field="adapters")
    return {name: AdapterFiles.from_directory(directory) for name, directory in adapters.items()}, False


# What the audit says of a merged fine-tune (``CLEF_FINETUNE.json``, kept in the manifest): who
# made it from what; the training config stays in the manifest (it is long and not provenance).
MERGED_AUDIT_KEYS = ("tool", "base_model", "checkpoint", "dtype", "head_dtype", "joint_schema_model_sha256")


def merged_audit(fine_tune: dict[str, Any] | None) -> dict[str, Any] | None:
    """The audit's ``fine_tune`` block of a merged release (None: not a fine-tune)."""
    if fine_tune is None:
        return None
    return {"merged": True} | {k: fine_tune[k] for k in MERGED_AUDIT_KEYS if k in fine_tune}


def cache_tag(adapter_sha256: str, scale: float) -> str:
    """What a fine-tune's cached states depend on beyond the tokens: its adapter and scale."""
    return f"@lora:{adapter_sha256[:32]}:{scale!r}"


@dataclass
class FineTune:
    """What a fine-tune adds to its base: a view of the base's tower applying its adapter, its head,
    and what the audit and ``info`` say of it."""

    tower: Tower
    head: torch.nn.Module
    provenance: answer.Provenance
    info: dict[str, Any]


def _check_adapter_file(path: Path, name: str) -> None:
    """gguf-py reads the whole header and tensor table first (llama.cpp aborts the process on some
    damaged files); then what llama.cpp's loader wants: a LoRA adapter for a ``qwen35`` model."""
    from clef_gguf.formats.gguf import field_value, open_gguf

    reader = open_gguf(path, field="adapter")
    found = {key: field_value(reader, key) for key in ADAPTER_GGUF_KEYS}
    for key, want in ADAPTER_GGUF_KEYS.items():
        if found[key] != want:
            raise errors.AdapterMismatch(f"fine-tune {name!r}: {path.name} has {key} {found[key]!r}, not "
                                         f"{want!r}: not a LoRA adapter for a qwen35 tower", field="adapter")


def check_fits(found: AdapterFiles, name: str, tower_file: str, *, n_embd: int, n_vocab: int,
               n_layer: int) -> None:
    """Refuse the fine-tune ``found`` for a base tower ``tower_file`` of these sizes when it was made
    for another (architecture, width, vocabulary, depth), or its adapter file is no qwen35 LoRA.
    Also the importance-matrix collector's check (``clef-gguf imatrix --adapter``)."""
    expected = {"architecture": TOWER_ARCH, "n_embd": n_embd, "n_vocab": n_vocab, "n_layer": n_layer}
    for key, value in expected.items():
        if found.base.get(key) != value:
            raise errors.AdapterMismatch(
                f"fine-tune {name!r} was made for a base with {key} {found.base.get(key)!r}, but "
                f"{tower_file} has {value!r}: it is for another model", field="adapter")
    _check_adapter_file(found.adapter, name)


def _refuse_second_scales(tower: Path, name: str) -> None:
    """llama.cpp applies an NVFP4 weight's second scale after a LoRA's term on the feed-forward weights and
    aborts the process rather than compute that (``build_ffn``'s GGML_ASSERT): refused here, by name."""
    from clef_gguf.formats.gguf import open_gguf, second_scaled

    scaled = second_scaled(open_gguf(tower))
    if scaled:
        raise errors.Unsupported(f"fine-tune {name!r}: {tower.name} holds {len(scaled)} NVFP4 weights with a "
                                 "second scale (e.g. " + scaled[0] + "), which llama.cpp cannot combine with a "
                                 "LoRA adapter: run the fine-tune on another quant of its base, or merge it "
                                 "(clef-finetune merge) and convert the merged release", field="adapter")


def load(tower: LanguageTower, base: answer.Provenance, hidden_size: int, head_dtype: torch.dtype,
         name: str, found: AdapterFiles, *, scale: float = 1.0, device: torch.device | None = None) -> FineTune:
    """The fine-tune ``found`` on the loaded base ``tower``: refused before anything runs when it
    does not fit it (another architecture or size, a head of another width)."""
    from clef_gguf.heads import load_head
    from clef_gguf.tower.llama_tower import Tower

    if not isinstance(tower, Tower):
        raise errors.InvalidSetting(f"fine-tune {name!r}: LoRA adapters run on the gguf backend "
                                    f"(llama.cpp), not on {base.backend}", field="adapter")
    _refuse_second_scales(tower.path, name)
    check_fits(found, name, tower.path.name, n_embd=tower.n_embd, n_vocab=tower.n_vocab,
               n_layer=tower.n_layer)
    # Hashed here, not taken from the manifest: these are the bytes that will run.
    adapter_sha, head_sha, config_sha = (sha256_file(p) for p in (found.adapter, found.head_weights,
                                                                    found.head_config))
    head = load_head(found.head_config, found.head_weights, hidden_size=hidden_size, dtype=head_dtype)
    if device is not None:
        head.to(device)  # beside the base's head
    view = tower.adapted(found.adapter, scale=scale, tag=cache_tag(adapter_sha, scale))
    digest = hashlib.sha256(f"{base.model_hash}\nadapter:{adapter_sha}:{scale!r}\n"
                            f"head:{head_sha}\n".encode()).hexdigest()
    audit: dict[str, Any] = {"name": name, "adapter_sha256": adapter_sha, "head_sha256": head_sha,
                             "head_config_sha256": config_sha, "scale": scale,
                             "base_model_hash": base.model_hash}
    provenance = dataclasses.replace(base, model_name=name, model_hash=digest,
                                     calibration_version=calibration.NONE, fine_tune=audit)
    info = {"name": name, "model_hash": digest,
            "fine_tune": audit | {"directory": str(found.directory), "source": found.source,
                                  "lora": found.lora}}
    return FineTune(view, head, provenance, info)
