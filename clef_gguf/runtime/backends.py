"""Which tower runs a model: llama.cpp on a GGUF, or PyTorch on an NVFP4 checkpoint.

Both give the pipeline the same three things: lexical rows (``rows(ids)``, ``hidden_size``,
``vocab_size``), a tower (``forward(ids, prefix, state, cache)``, ``n_embd``...) and a label
for the provenance; everything after them (head, answer, API, CLI, server) is shared.

:data:`BACKENDS` is the one registry of backends, by the name ``--backend`` and a model's files use:
the choices ``--backend`` accepts, the errors, the provenance label (``info["backend"]``), which
settings apply (:func:`refuse_llama_settings`) and what ``tune`` measures all read it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from clef_gguf.core import errors
from clef_gguf.formats import files as model_files
from clef_gguf.runtime import tuning
from clef_gguf.runtime.settings import LoadSettings
from clef_gguf.runtime.tuning import RunSettings

if TYPE_CHECKING:
    from clef_gguf.pipeline.lexical import RowStore
    from clef_gguf.tower.protocol import LanguageTower

# The settings of llama.cpp towers: given for a backend that does not run in llama.cpp, they are refused.
LLAMA_ONLY = ("decode_chunk", "flash_attention", "pack_size")


def choose(asked: str | None, found: model_files.ModelFiles) -> str:
    """The backend asked for, checked against what the files are (None/``auto``: the files')."""
    if asked in (None, "auto"):
        return found.backend
    if asked not in BACKENDS:
        raise errors.InvalidSetting(f"backend must be one of auto, {', '.join(BACKENDS)} (got {asked!r})",
                                    field="backend")
    if asked != found.backend:
        raise errors.InvalidSetting(f"--backend {asked} needs {BACKENDS[asked].files}, but {found.tower} is "
                                    f"{BACKENDS[found.backend].files}", field="backend")
    return asked


def refuse_llama_settings(settings: LoadSettings, tower: Path) -> None:
    """A llama.cpp setting given for a tower that does not run in llama.cpp is refused, not ignored."""
    for name in LLAMA_ONLY:
        if getattr(settings, name) != tuning.UNSET[name]:
            flag = name.replace("_", "-")
            raise errors.InvalidSetting(f"--{flag} sets how llama.cpp runs a GGUF tower; {tower.name} is not "
                                        f"one (leave it unset)", field=name)


def gpu_layers(asked: int | str | None, tower: Path, n_embd: int, context: int) -> int | str:
    """``"all"`` -> -1, a count as given, ``"auto"``: the device policy's placement (all layers when
    this build can offload and the model fits the GPU, else 0), as ``clef-gguf pick`` reports."""
    if asked == "all":
        return -1
    if asked not in (None, "auto"):
        return asked  # Tower.load checks it
    from clef_gguf.tower.llama_tower import gpu_offload

    if not gpu_offload():  # a CPU-only build: nothing to decide, and no probe to run
        return 0
    from clef_gguf.models import machine, placement
    from clef_gguf.models.catalog import load_catalog

    catalog = load_catalog()
    family = next((f for f in catalog.families.values() if f.architecture.hidden_size == n_embd),
                  catalog.family("clef-flash"))  # an unknown model: Clef-Flash's memory model
    return placement.gpu_layers(machine.probe(), tower.stat().st_size, family, context_tokens=context)


def device_free_memory(offloaded: bool) -> int:
    """Bytes the device policy leaves free: the GPU's memory when the tower is offloaded to a GPU of
    its own, else host RAM. Runs the device probe (``nvidia-smi``): never under the tower's lock."""
    from clef_gguf.models import machine, placement

    return placement.free_bytes(machine.probe(check_llama=False), on_gpu=offloaded)


@dataclass
class Opened:
    """A model's tower files, opened far enough to check them; the tower itself loads last."""

    backend: str  # a name of BACKENDS
    lexical: RowStore
    quant: str
    # the settings -> the tower, and the run settings it was loaded with (given, tuned or default)
    load_tower: Callable[[LoadSettings], tuple[LanguageTower, RunSettings]]
    model_hash: Callable[[], str]

    @property
    def label(self) -> str:
        """What the vocabulary is called in errors: "GGUF" or "checkpoint"."""
        return BACKENDS[self.backend].label

    @property
    def runner(self) -> str:
        return BACKENDS[self.backend].runner


def open_gguf_tower(found: model_files.ModelFiles) -> Opened:
    from clef_gguf.formats.gguf import NATIVE_ARCH, TOWER_ARCH, check_header, field_value, open_gguf, precision_label
    from clef_gguf.pipeline.lexical import LexicalRows
    from clef_gguf.tower.llama_tower import Tower, gpu_offload

    # gguf-py validates the whole file table first: llama.cpp aborts on some corrupt files.
    reader = open_gguf(found.tower)
    arch = field_value(reader, "general.architecture")
    if arch != TOWER_ARCH:
        raise errors.CorruptModel(
            f"{found.tower.name} has architecture {arch!r}; clef-gguf runs {TOWER_ARCH!r} towers"
            + (" (convert a native clef GGUF with `clef-gguf convert split`)" if arch == NATIVE_ARCH
               else ""), field="tower")
    check_header(reader, found.tower)  # llama.cpp aborts on some bad hyperparameters
    lexical = LexicalRows(reader)

    def load(settings: LoadSettings) -> tuple[LanguageTower, RunSettings]:
        if settings.nvfp4_dtype != "auto":  # llama.cpp's kernels choose their own precision
            raise errors.InvalidSetting(f"nvfp4_dtype {settings.nvfp4_dtype!r} sets the nvfp4 backend's compute "
                                        f"dtype; {found.tower.name} runs in llama.cpp (leave it auto)",
                                        field="nvfp4_dtype")
        layers = gpu_layers(settings.gpu_layers, found.tower, lexical.hidden_size, settings.max_length)
        device = "gpu" if layers != 0 and gpu_offload() else "cpu"
        run = tuning.for_tower(settings, found.tower, device)
        return Tower.load(found.tower, n_ctx=settings.max_length, threads=run.threads, gpu_layers=layers,
                          n_batch=run.decode_chunk, attention=run.attention, pack=run.pack,
                          free_memory=device_free_memory), run

    return Opened("gguf", lexical, precision_label(reader), load,
                  lambda: found.sha256_of(found.tower))


def open_nvfp4_tower(found: model_files.ModelFiles) -> Opened:
    from clef_gguf.tower.nvfp4.checkpoint import Checkpoint
    from clef_gguf.tower.nvfp4.lexical import CheckpointRows

    checkpoint = Checkpoint(found.tower)
    lexical = CheckpointRows(checkpoint)

    def load(settings: LoadSettings) -> tuple[LanguageTower, RunSettings]:
        from clef_gguf.tower.nvfp4.tower import NVFP4Tower

        refuse_llama_settings(settings, found.tower)
        run = tuning.for_tower(settings, None, None)  # tune measures llama.cpp towers only
        return NVFP4Tower.load(found.tower, n_ctx=settings.max_length, threads=settings.threads,
                               gpu_layers=settings.gpu_layers, dtype=settings.nvfp4_dtype), run

    def model_hash() -> str:
        """One digest over the config and every shard (each hashed once, or as recorded)."""
        digest = hashlib.sha256()
        for path in [checkpoint.config_path, *checkpoint.shards]:
            digest.update(f"{path.name}:{found.sha256_of(path)}\n".encode())
        return digest.hexdigest()

    return Opened("nvfp4", lexical, checkpoint.scheme.name, load, model_hash)


@dataclass(frozen=True)
class Backend:
    """One way to run a tower, everything the rest of the code asks about it."""

    runner: str  # the provenance label: ``info["backend"]``, the audit's ``backend``
    files: str  # what its tower files are, in errors
    label: str  # what its vocabulary is called in errors
    llama: bool  # runs in llama.cpp: LLAMA_ONLY's settings apply, and ``tune`` measures it
    opener: Callable[[model_files.ModelFiles], Opened]  # the files -> the tower, not loaded yet


# The registry: a new backend is one row here (and its files recognised by ``formats.files``).
BACKENDS: dict[str, Backend] = {
    "gguf": Backend("llama-cpp-python", "a GGUF tower", "GGUF", True, open_gguf_tower),
    "nvfp4": Backend("torch-nvfp4", "a compressed-tensors NVFP4 checkpoint", "checkpoint", False, open_nvfp4_tower),
}


def open_tower_files(found: model_files.ModelFiles, backend: str | None) -> Opened:
    return BACKENDS[choose(backend, found)].opener(found)
