"""A release's vision tower, written into a converted model directory.

``write_vision(src, out)`` writes ``vision_config.json`` (the release's ``vision_config``, verbatim) and
``vision.safetensors`` (its ``model.visual.*`` tensors, prefix stripped, dtypes and shapes as stored), after
checking them as ``clef_gguf.vision`` will when it loads them. It returns the manifest's ``vision`` entry,
``{"weights": ..., "config": ...}``, or None for a text-only release.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from clef_gguf.core.errors import ConversionError, CorruptModel
from clef_gguf.vision import load


def write_vision(src: Path, out: Path) -> dict[str, str] | None:
    """Write the vision part of the release ``src`` into the directory ``out``; None when it has none."""
    src, out = Path(src), Path(out)
    try:
        raw = load.release_config(src)
        found = load.release_sources(src)
        if raw is None and not found:
            return None
        if raw is None:
            raise ConversionError(f"{src} holds vision tensors but its config.json has no vision_config",
                                  field="vision")
        if not found:  # a config left over from the multimodal base; the checkpoint is text-only
            return None
        config = load.parse_config(raw, source=f"{load.RELEASE_CONFIG} vision_config")
        tensors = load.read_tensors(found, config)
    except CorruptModel as error:
        raise ConversionError(f"the release's vision tower: {error.message}", field="vision") from None
    save_file(tensors, str(out / load.VISION_WEIGHTS), metadata={"format": "pt"})
    (out / load.VISION_CONFIG).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    return {"weights": load.VISION_WEIGHTS, "config": load.VISION_CONFIG}
