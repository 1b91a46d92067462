"""Loading: ``LoadSettings`` -> the files -> one base ``Clef`` -> its fine-tunes -> ``Models``.

The four files are opened and checked against each other before the tower loads (a bad head or
tokenizer costs no tower load); the tower is closed again if anything after it fails.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clef_gguf.core import errors
from clef_gguf.core.cpus import set_torch_threads
from clef_gguf.core.limits import MiB
from clef_gguf.formats import calibration as calibration_file
from clef_gguf.formats import files as model_files
from clef_gguf.heads import head_scalars, load_head
from clef_gguf.media import support as media_support
from clef_gguf.models.catalog import is_catalog_name
from clef_gguf.pipeline import answer
from clef_gguf.pipeline.encode import TEMPLATE_SHA256, Encoder
from clef_gguf.runtime import backends, devices, finetunes
from clef_gguf.runtime.registry import M, Models
from clef_gguf.runtime.settings import LoadSettings
from clef_gguf.tower.cache import StateCache
from clef_gguf.vision.cache import VisionCache

log = logging.getLogger("clef_gguf")

# The head's dtype. "precision" is the audit's name for the tower's weight format (q4_k_m, f32...),
# so the head's is called head_dtype everywhere (``precision=`` stays accepted as its old spelling).
HEAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve(settings: LoadSettings) -> model_files.ModelFiles:
    """A model directory, a .gguf beside its head files, explicit paths, or a catalog name."""
    explicit = {"tower": settings.gguf, "head_weights": settings.head, "head_config": settings.head_config,
                "tokenizer": settings.tokenizer}
    model = settings.model
    if model is None:
        missing = [k for k, v in explicit.items() if v is None]
        if missing:
            raise errors.MissingField("give a model directory or all of --gguf, --head, "
                                      f"--head-config, --tokenizer (missing: {', '.join(missing)})",
                                      field="model")
        gguf = Path(str(settings.gguf))
        found = model_files.ModelFiles(gguf, Path(str(settings.head)), Path(str(settings.head_config)),
                                       Path(str(settings.tokenizer)), name=gguf.stem)
        found.check_exist()
        return found
    path = Path(model)
    if path.is_dir():
        found = model_files.from_directory(path, backend=settings.backend)
    elif path.suffix == ".gguf":
        d = path.parent
        found = model_files.ModelFiles(path, d / model_files.HEAD_WEIGHTS, d / model_files.HEAD_CONFIG,
                                       d / model_files.TOKENIZER, name=path.stem)
    elif not path.exists() and is_catalog_name(str(model)):
        from clef_gguf.models import hub  # catalog names: clef-flash:Q4_K_M, clef-flash:auto

        found = hub.resolve(str(model), allow_download=settings.allow_download,
                            context_tokens=settings.max_length)
    else:
        raise errors.ModelNotFound(
            f"model not found: {model} is neither a model directory or .gguf file, nor a catalog "
            "name (clef-flash, clef-flash:Q4_K_M, clef:auto, ...; see `clef-gguf list --available`)",
            field="model")
    for role, value in explicit.items():  # explicit paths override what the directory or catalog named
        if value is not None:
            setattr(found, role, Path(value))
    found.check_exist()
    return found


def load(settings: LoadSettings, make: Callable[..., M]) -> Models[M]:
    """Every model ``settings`` name: the base, and its fine-tunes on the same tower, each made by
    ``make`` (``Clef``: handed in by ``Clef.load``, so that loading does not import the model)."""
    devices.check_head_device(settings.head_device)  # an impossible device fails before any file loads
    cal = calibration_file.load(settings.calibration)  # a bad file fails before the tower loads
    found = resolve(settings)
    opened = backends.open_tower_files(found, settings.backend)
    lexical = opened.lexical
    joint = load_head(found.head_config, found.head_weights, hidden_size=lexical.hidden_size,
                      dtype=HEAD_DTYPES[settings.head_dtype])  # checked now; its tuned dtype once the tower is placed
    encoder = Encoder.from_file(found.tokenizer, settings.max_length)
    # The largest id as well as the count: a damaged tokenizer.json can hold ids past its size.
    ids = encoder.tokenizer.get_vocab(with_added_tokens=True).values()
    n_ids = max(encoder.vocab_size, max(ids, default=0) + 1)
    if n_ids > lexical.vocab_size:
        raise errors.HeadMismatch(
            f"the tokenizer has {n_ids} token ids but the {opened.label} vocab has only "
            f"{lexical.vocab_size}: they are not from the same release", field="tokenizer")
    tower, run = opened.load_tower(settings)
    try:
        # The head runs after the tower on the same cores: torch gets as many threads as the tower.
        set_torch_threads(settings.head_threads or tower.threads)
        device = devices.head_device(run.head_device, tower.cuda_device)
        joint.to(device, HEAD_DTYPES[run.head_dtype])
        if run.head_dtype == "fp32":
            devices.exact_fp32(device)
        if tower.n_embd != lexical.hidden_size:
            raise errors.CorruptModel(f"n_embd {tower.n_embd} != lm_head width {lexical.hidden_size}",
                                      field="tower")
        model_hash = opened.model_hash()  # the files that run, not the ones a manifest named
        provenance = answer.Provenance(found.name, model_hash, opened.runner, opened.quant, TEMPLATE_SHA256,
                                       fine_tune=finetunes.merged_audit(found.fine_tune))
        info = {"name": found.name, "quant": opened.quant, "revision": found.revision,
                "files": {p.name: found.known_sha256(p) for p in found.paths().values()}
                | {found.tower.name: model_hash},
                "backend": opened.runner, "precision": opened.quant, "head_dtype": run.head_dtype,
                "head_device": str(device),
                "max_length": settings.max_length, "n_embd": tower.n_embd, "lexical_rows": lexical.type_name,
                "lm_head_avoided": tower.uses_nextn, "gpu_layers": tower.gpu_layers,
                "threads": tower.threads, "head_threads": torch.get_num_threads(), "strict": settings.strict,
                "state_cache_mb": settings.state_cache_mb, "vision_cache_mb": settings.vision_cache_mb,
                "vision_engine": settings.vision_engine, "calibration_version": provenance.calibration_version,
                "tuned": run.from_tune}
        info |= tower.details()  # the backend's own facts (nvfp4: kernel, device)
        log.info("loaded %s (%s, n_embd %d) on %s, head scalars %s", found.tower.name, opened.quant,
                 tower.n_embd, "the GPU" if tower.gpu_layers else "the CPU", head_scalars(joint))
        media = media_support.MediaSupport.of(found, opened.backend, threads=tower.threads,
                                              cache=VisionCache(int(settings.vision_cache_mb * MiB)),
                                              engine=settings.vision_engine)
        base = make(found, tower, lexical, joint, encoder, provenance, info | {"vision": media.describe()},
                    strict=settings.strict, state_cache=StateCache(int(settings.state_cache_mb * MiB)),
                    media=media, settings=settings)
        tunes, default = _fine_tunes(base, settings)
        if not cal.is_identity:  # the model that answers by default applies it, wherever it is held
            chosen: Any = tunes.get(default, base)
            cal.check_bound(chosen.calibration_binding())
            if default in tunes:
                tunes[default] = chosen.calibrated(cal)
            else:
                base = chosen.calibrated(cal)
        return Models(base, tunes, default=default, strict=settings.strict)
    except BaseException:
        tower.close()
        raise


def _fine_tunes(base: M, settings: LoadSettings) -> tuple[dict[str, M], str]:
    """The fine-tunes ``settings.adapters`` names, each a view of the base's tower, by name, and the
    name of the model that answers by default."""
    names, fine_default = finetunes.named(settings.adapters)
    tunes: dict[str, M] = {}
    for name, found in names.items():
        if name == base.name:
            raise errors.InvalidSetting(f"the fine-tune name {name!r} is already the base's name: give it "
                                        "another", field="adapters")
        parts: Any = base  # a Clef (a dataclass): the fine-tune is the base with its own parts
        tune = finetunes.load(parts.tower, parts.provenance, parts.lexical.hidden_size, parts.head_dtype, name, found,
                              device=parts.head_device)
        tunes[name] = dataclasses.replace(parts, tower=tune.tower, head=tune.head, provenance=tune.provenance,
                                          info=parts.info | tune.info, calibration=calibration_file.IDENTITY, base=base)
    return tunes, next(iter(names)) if fine_default else base.name
