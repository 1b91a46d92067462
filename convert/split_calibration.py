"""Upstream's temperatures of a native-clef GGUF -> a calibration file beside the split model.

llama.cpp's server divides each question's logits by ``<arch>.decision.temperature.<type>[.<bucket>]``
before the softmax (docs/design and ``clef_gguf.formats.calibration`` name the buckets). The
tower GGUF carries no decision keys, so ``convert split`` keeps them as ``calibration.json``,
bound to the split files, and names it in the manifest: ``--calibration OUT/calibration.json``
then applies what upstream applies. A file whose temperatures are all 1.0 (or absent) changes
nothing and gets none.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf

from clef_gguf.formats import files
from clef_gguf.pipeline.encode import TEMPLATE_SHA256
from clef_gguf.core.errors import ClefError, ConversionError
from clef_gguf.formats import calibration as cal
from clef_gguf.formats.gguf import field_value
from clef_gguf.core.questions import QUESTION_TYPES

FILE = "calibration.json"
BUCKETS = tuple(name for _, name in cal.BANDS)


def upstream_temperatures(reader: gguf.GGUFReader, arch: str) -> dict[str, float]:
    """``{"<type>[.<bucket>]": T}`` from the file's temperature keys; a key the runtime could not
    apply as upstream does (unknown type or bucket, a value out of range) is refused."""
    prefix = f"{arch}.decision.temperature."
    table: dict[str, float] = {}
    for key in reader.fields:
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        qtype, _, bucket = name.partition(".")
        if qtype not in QUESTION_TYPES or (bucket and bucket not in BUCKETS):
            raise ConversionError(f"{key}: not a temperature key llama.cpp reads (types "
                                  f"{', '.join(QUESTION_TYPES)}; buckets {', '.join(BUCKETS)})")
        value = field_value(reader, key)
        low, high = cal.T_RANGE
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or not low <= value <= high:
            raise ConversionError(f"{key} = {value!r}: a temperature must be a number in "
                                  f"{low}..{high}")
        table[name] = float(value)
    return table


def write_calibration(directory: Path, table: dict[str, float], source: str) -> dict[str, str] | None:
    """Write ``FILE`` into the model ``directory`` (its manifest already written) bound to its
    files, and name it in the manifest; returns the manifest's entry (file, version, source), or
    None (nothing written) when every T is 1.0."""
    if all(t == 1.0 for t in table.values()):
        return None
    manifest = files.read_manifest(directory)
    hashes = {name: entry["sha256"] for name, entry in manifest["files"].items()}
    bound = {"tower_sha256": hashes[manifest["tower"]],
             "head_sha256": hashes[manifest["head_weights"]],
             "head_config_sha256": hashes[manifest["head_config"]],
             "prompt_template_sha256": TEMPLATE_SHA256, "adapter_sha256": None}
    temperatures = {name: {"temperature": t, "source": "gguf"} for name, t in sorted(table.items())}
    try:
        calibration = cal.Calibration.build({"bound_to": bound, "temperatures": temperatures,
                                             "fit": {"method": "upstream", "source": source}})
    except ClefError as exc:
        raise ConversionError(exc.message) from None
    path = calibration.write(directory / FILE)
    manifest["files"][FILE] = {"sha256": files.sha256_file(path), "size": path.stat().st_size}
    manifest["calibration"] = {"file": FILE, "version": calibration.version,
                               "source": "the GGUF's decision.temperature.* keys"}
    # Written after every file it lists: the runtime trusts the hashes of files not newer than it.
    (directory / files.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest["calibration"]
