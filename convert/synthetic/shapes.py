"""The shapes random models are made at: ``convert.synthetic.tiny``'s presets and each catalog family's
(``flash9b``: Clef-Flash's 9B, read from ``models/catalog.json``, its one home), and a preset's tensor
plan: every tensor of the release in draw order, mapped to its GGUF name, edits and storage type."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf

from clef_gguf.convert import tensor_map as tm
from clef_gguf.convert.hf_to_gguf import SUPPORTED, text_dims
from clef_gguf.convert.synthetic import tiny
from clef_gguf.core.errors import ConversionError

# preset -> the catalog family whose every tower shape is confirmed (pick's probe runs at it). The 27B's
# linear-attention and feed-forward widths are not in its card: no preset rather than a guess.
CATALOG_FAMILIES = {"flash9b": "clef-flash"}
_DEMO_BPE_VOCAB = 512  # the demo tokenizer's merges; the vocab is padded to the family's size


# The model catalog's data file: models/ beside convert/ in the clone, clef_gguf/models/ installed, or
# what $CLEF_GGUF_CATALOG names (as models.catalog reads it). Read as data: models.catalog imports convert,
# so convert may not import it (tests/test_layout.py).
CATALOG_JSON = Path(__file__).resolve().parents[2] / "models" / "catalog.json"
CATALOG_ENV = "CLEF_GGUF_CATALOG"  # models.catalog.CATALOG_ENV, which a test holds equal


def catalog_path() -> Path:
    """The catalog file ``models.catalog.load_catalog`` reads: ``$CLEF_GGUF_CATALOG``, else the packaged one."""
    return Path(os.environ.get(CATALOG_ENV) or CATALOG_JSON)


def preset_for(family: str) -> str | None:
    """The preset with ``family``'s shapes, or None when they are not confirmed."""
    return next((preset for preset, name in CATALOG_FAMILIES.items() if name == family), None)


def catalog_preset(family: str) -> dict:
    """The preset of ``family``'s shape, read from the model catalog, with the real joint head's size."""
    path = catalog_path()
    try:
        a = json.loads(path.read_text(encoding="utf-8"))["families"][family]["architecture"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConversionError(f"the catalog {path} gives no architecture for family {family!r}: {exc}") from exc
    return dict(hidden=a["hidden_size"], layers=a["layers"], interval=a["full_attention_interval"],
                ffn=a["feed_forward"], heads=a["attention_heads"], kv_heads=a["kv_heads"], head_dim=a["head_dim"],
                lin_k_heads=a["linear_key_heads"], lin_v_heads=a["linear_value_heads"],
                lin_head_dim=a["linear_head_dim"], bpe_vocab=_DEMO_BPE_VOCAB, vocab_size=a["vocab_size"],
                mrope=list(a["mrope_sections"]), rope_theta=a["rope_theta"], max_pos=a["max_context"], shards=1,
                head=dict(hidden_size=a["hidden_size"], **a["head"]))


def presets() -> dict[str, dict]:
    return {**tiny.PRESETS, **{name: catalog_preset(family) for name, family in CATALOG_FAMILIES.items()}}


def preset_config(preset: str, layers: int | None = None) -> dict:
    if preset not in presets():
        raise ConversionError(f"unknown preset {preset!r}; choose one of {', '.join(presets())}")
    p = dict(presets()[preset])
    if layers is not None:
        if layers < 1 or layers % p["interval"]:
            raise ConversionError(f"--layers must be a positive multiple of {p['interval']} "
                                  "(the full-attention interval), so the 3:1 pattern stays whole")
        p["layers"] = layers
    return p


@dataclass
class PlannedTensor:
    """One tensor of a preset's release, and where and how its GGUF holds it."""

    hf_name: str          # as convert.synthetic.tiny names it
    shape: list[int]      # Hugging Face shape
    rule: tuple           # convert.synthetic.tiny's init rule
    gguf_name: str | None  # None: a vision/MTP tensor, drawn and dropped
    edits: tuple[str, ...] = ()
    qtype: gguf.GGMLQuantizationType | None = None
    layout: tuple = ()

    @property
    def stored(self) -> tuple[str, gguf.GGMLQuantizationType]:
        """(GGUF name, tensor type) of a tensor the file holds."""
        if self.gguf_name is None or self.qtype is None:
            raise ConversionError(f"{self.hf_name} is drawn and dropped: the GGUF does not hold it")
        return self.gguf_name, self.qtype


def plan(p: dict, outtype: str, tok) -> tuple[dict, tm.Dims, list[PlannedTensor]]:
    """(text config, dims, every tensor of convert.synthetic.tiny's list in its draw order, mapped)."""
    text = tiny.make_config(p, tok)["text_config"]
    d = text_dims(text, tied=False)
    prefix = SUPPORTED["Qwen3_5ForConditionalGeneration"][1]
    items = []
    for name, shape, rule in tiny.tensor_specs(p):
        if name.startswith(tm.SKIP_PREFIXES):
            items.append(PlannedTensor(name, shape, rule, None))
            continue
        rel = name if name == "lm_head.weight" else name[len(prefix):]
        gg, edits = tm.gguf_name(rel)
        out_shape = tm.output_shape(shape, edits)
        qtype = tm.storage_type(gg, out_shape, outtype)
        items.append(PlannedTensor(name, shape, rule, gg, edits, qtype, tm.encoded_layout(out_shape, qtype)))
    return text, d, items
