"""``--keep-layers RANGE=TYPE``: decoder layers kept at a wider tensor type than the quant's mix.

Published ports of Clef found quantization damage concentrated in the early layers, and kept them
wider (an int8 port kept layers 0-11 in fp16). This module parses and checks the flag, turns it into
llama.cpp's per-tensor overrides, and names the result (``q4_k_m+keep[0-7=q8_0]``).

How llama.cpp 0.3.36 applies overrides (vendored ``src/llama-quant.cpp``, ``llama_tensor_get_type``):
each ``tt_overrides`` pattern is a ``std::regex`` tried with ``regex_search`` in order, the first match
wins; a matched tensor skips the ftype's mix entirely (``manual``), then gets the usual shape fallback
(a 256-block type on a row that is not a multiple of 256 becomes a 32-block one). Overrides apply to
tensors the quantizer may quantize at all (2-D ``*weight``, no norms, no ``ssm_conv1d``), and only
when the ftype's own type is a quantized one: F16/BF16/F32 files ignore them. Two consequences shape
what we ask for:

* the mix counts the tensors it places (``i_ffn_down``, ``i_attention_wv``) to find their layer, and a
  manual tensor is not counted: overriding only layers 0-7 would shift the mix of every later layer
  (layer 8 placed as layer 0). So a dry run of the plain quantization first says what every tensor
  would get, and *every* ``blk.N`` tensor is overridden: the layers not kept with exactly the plain
  mix's type, the kept ones with TYPE;
* the mix already puts some tensors above its base type (Q4_K_M: ``attn_v`` and some ``ffn_down``
  at Q6_K): a kept tensor takes TYPE only where TYPE has more bits per weight than the mix gives it,
  so keeping a layer never narrows any of its tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from clef_gguf.core.errors import InvalidSetting
from clef_gguf.formats.gguf import KEEP_LAYERS_KEY

FLAG, FIELD = "--keep-layers", "keep_layers"
# Where the quantized tower says which layers were kept (formats.gguf.precision_label reads it back):
# llama.cpp's quantizer writes kv_overrides into its output, as it writes quantize.imatrix.*.
GGUF_KEY = KEEP_LAYERS_KEY
# The tensor types a layer may be kept at: the ones the published mixes are made of, 3 bits and up.
# Ternary (TQ*), FP4 and the IQ1/IQ2 types would not keep anything "wider" worth having.
KEEP_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0",
              "IQ4_NL", "IQ4_XS", "Q3_K", "IQ3_S")
# The ggml type each quant's mix is built around (llama-quant.cpp llama_ftype_get_default_type): a
# kept TYPE must have more bits per weight than this, or it keeps nothing wider.
BASE_TYPE = {"Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q5_1": "Q5_1", "Q5_K_M": "Q5_K", "Q5_K_S": "Q5_K",
             "Q5_0": "Q5_0", "Q4_K_M": "Q4_K", "Q4_1": "Q4_1", "IQ4_NL": "IQ4_NL", "Q4_K_S": "Q4_K",
             "Q4_0": "Q4_0", "IQ4_XS": "IQ4_XS", "Q3_K_L": "Q3_K", "Q3_K_M": "Q3_K", "IQ3_M": "IQ3_S",
             "IQ3_S": "IQ3_S", "Q3_K_S": "Q3_K", "IQ3_XS": "IQ3_S", "IQ3_XXS": "IQ3_XXS", "Q2_K": "Q2_K",
             "Q2_K_S": "Q2_K", "IQ2_M": "IQ2_S", "IQ2_S": "IQ2_XS", "Q2_0": "Q2_0", "IQ2_XS": "IQ2_XS",
             "IQ2_XXS": "IQ2_XXS", "IQ1_M": "IQ1_M", "IQ1_S": "IQ1_S", "Q1_0": "Q1_0"}
# Our writer's lossless types: every layer already is at that type, nothing can be kept wider by it,
# and llama.cpp ignores overrides in an F32/F16/BF16 file.
UNQUANTIZED = ("f32", "f16", "bf16")
_LIMIT = 127  # bytes of a llama_model_kv_override string


def _refuse(value: str, why: str) -> InvalidSetting:
    return InvalidSetting(f"{FLAG} {value!r}: {why}", field=FIELD)


def bits_per_weight(type_name: str) -> float:
    import gguf

    from clef_gguf.formats.gguf import ensure_gguf_types

    ensure_gguf_types()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name.upper()]]
    return size * 8 / block


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 3, 7] -> ``0-3,7``."""
    runs: list[list[int]] = []
    for n in sorted(layers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class KeepLayers:
    """Layer -> the tensor type it is kept at (upper case ggml names: ``Q8_0``, ``F16``)."""

    layers: dict[int, str]

    def rules(self) -> list[dict[str, str]]:
        """``[{"layers": "0-7", "type": "Q8_0"}]``, one per type, in layer order: the manifest's."""
        by_type: dict[str, list[int]] = {}
        for layer, kind in sorted(self.layers.items()):
            by_type.setdefault(kind, []).append(layer)
        return [{"layers": _ranges(ls), "type": t} for t, ls in by_type.items()]

    def label(self) -> str:
        """``0-7=q8_0`` (``0-3=f16,4-7=q8_0``): what the precision and the GGUF key say."""
        return ",".join(f"{r['layers']}={r['type'].lower()}" for r in self.rules())

    def target(self, name: str, planned: str) -> str:
        """The type tensor ``name`` gets: the plain mix's ``planned`` type, or the kept type where
        that has more bits per weight."""
        found = re.match(r"blk\.(\d+)\.", name)
        kept = self.layers.get(int(found.group(1))) if found else None
        if kept is None or bits_per_weight(kept) <= bits_per_weight(planned):
            return planned.upper()
        return kept


def parse(values: list[str] | tuple[str, ...] | None) -> KeepLayers | None:
    """The repeated flag's values -> KeepLayers (None when not given). Refuses (InvalidSetting,
    field keep_layers) a malformed RANGE, an unknown TYPE, and a layer given two types."""
    if not values:
        return None
    layers: dict[int, str] = {}
    for value in values:
        text = str(value).strip()
        spec, sep, kind = text.rpartition("=")
        if not sep or not spec.strip():
            raise _refuse(text, "expected RANGE=TYPE, e.g. 0-7=Q8_0 or 0-3,30-31=f16")
        kind = kind.strip().upper()
        if kind not in KEEP_TYPES:
            raise _refuse(text, f"unknown TYPE {kind or '(empty)'!r}; choose one of {', '.join(KEEP_TYPES)}")
        for part in spec.split(","):
            found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
            if not found:
                raise _refuse(text, f"{part.strip() or '(empty)'!r} is not a layer or a range "
                                    "FIRST-LAST of layer numbers (0-7, 10, 0-3,30-31)")
            first = int(found.group(1))
            last = int(found.group(2)) if found.group(2) is not None else first
            if last < first:
                raise _refuse(text, f"range {first}-{last} ends before it starts")
            for layer in range(first, last + 1):
                if layers.get(layer, kind) != kind:
                    raise _refuse(text, f"layer {layer} is already kept at {layers[layer]}: "
                                        "overlapping ranges must name the same TYPE")
                layers[layer] = kind
    return KeepLayers(layers)


def check(keep: KeepLayers, outtype: str, n_layers: int | None) -> None:
    """Refuse what cannot be kept wider: an unquantized outtype, a layer the model does not have
    (``n_layers``; None: not checked), a TYPE not wider than the quant's base type (keeping a layer
    narrower is not keeping it)."""
    if outtype.lower() in UNQUANTIZED:
        raise InvalidSetting(f"{FLAG} needs a quantized --outtype (q8_0 or a llama.cpp quant): {outtype} "
                             "already stores every layer at that width", field=FIELD)
    base = BASE_TYPE.get(outtype.upper())
    if base is None:
        raise InvalidSetting(f"{FLAG} works with q8_0 and the llama.cpp quant types, not with {outtype}",
                             field=FIELD)
    past = sorted(n for n in keep.layers if n_layers is not None and n >= n_layers)
    if past and n_layers is not None:
        raise InvalidSetting(f"{FLAG}: layer {past[0]} does not exist: the model has {n_layers} decoder "
                             f"layers (0-{n_layers - 1})", field=FIELD)
    for rule in keep.rules():
        if bits_per_weight(rule["type"]) <= bits_per_weight(base):
            raise InvalidSetting(
                f"{FLAG} {rule['layers']}={rule['type']}: {rule['type']} is not wider than {outtype}'s "
                f"{base} ({bits_per_weight(rule['type']):g} vs {bits_per_weight(base):g} bits per "
                "weight): a kept layer must be stored wider than the rest", field=FIELD)
    if len(keep.label().encode()) > _LIMIT:
        raise InvalidSetting(f"{FLAG}: {len(keep.rules())} types over scattered layers do not fit the "
                             f"{_LIMIT}-byte GGUF note; use fewer, wider ranges", field=FIELD)


def block_count(src: Path) -> int:
    """The decoder layer count of a tower GGUF, a converted model directory (its tower's
    ``qwen35.block_count``) or a HF release (``num_hidden_layers``)."""
    from clef_gguf.formats import files
    from clef_gguf.formats.gguf import field_value, open_gguf

    src = Path(src)
    if src.is_file():
        return int(field_value(open_gguf(src), "qwen35.block_count"))
    if (src / files.MANIFEST).is_file():
        return int(field_value(open_gguf(files.from_directory(src).tower), "qwen35.block_count"))
    from clef_gguf.convert.hf_to_gguf import load_config

    return int(load_config(src)[1]["num_hidden_layers"])


def resolve(values, outtype: str, src: Path) -> KeepLayers | None:
    """Parse and check the flag against ``src`` (the converted directory or the release): everything
    it refuses, it refuses before any conversion work."""
    keep = values if isinstance(values, KeepLayers) else parse(values)
    if keep is not None:
        check(keep, outtype, None)  # the flag's own faults before reading the source
        check(keep, outtype, block_count(src))
    return keep


# The dry run's line per tensor (llama-quant.cpp main loop): the source type, then the new type in
# parentheses when the quantizer changes it.
_PLANNED = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\w+), size =\s*[\d.]+ MiB"
                      r"(?: ->\s*[\d.]+ MiB \((\w+)\))?")


def planned_types(log: str) -> dict[str, str]:
    """Tensor name -> the type a plain quantization gives it, from a dry run's log."""
    return {m.group(1): (m.group(3) or m.group(2)).upper() for m in _PLANNED.finditer(log)}


def overrides(keep: KeepLayers, planned: dict[str, str]) -> list[tuple[str, str]]:
    """(anchored regex, type) for every ``blk.N`` tensor: see the module docstring for why all."""
    return [(f"^{re.escape(name)}$", keep.target(name, kind)) for name, kind in planned.items()
            if name.startswith("blk.")]


def kept_tensors(keep: KeepLayers, path: Path) -> dict[str, dict[str, int]]:
    """What the written tower holds in the kept layers: ``{"0-7=Q8_0": {"Q8_0": 40, "F32": 24}}``."""
    from clef_gguf.formats.gguf import open_gguf

    out: dict[str, dict[str, int]] = {}
    names = {layer: f"{r['layers']}={r['type']}" for r in keep.rules()
             for layer, kind in keep.layers.items() if kind == r["type"]}
    for t in open_gguf(path).tensors:
        found = re.match(r"blk\.(\d+)\.", t.name)
        if found and int(found.group(1)) in names and len(t.shape) >= 2:
            counts = out.setdefault(names[int(found.group(1))], {})
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return out
