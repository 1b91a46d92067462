"""Importance matrices in llama.cpp's formats: read, write, and a flat one made from a tower GGUF.

llama.cpp's quantizer weighs each input column of a weight by its mean squared activation; the
very-low-bit IQ types (and Q2_K inside Q2_K_S files) refuse to quantize without those weights.
``llama_model_quantize`` takes them as an array of ``{name, data, size}`` (one float per input
column per expert, already divided by the token count), which is what ``read`` returns.

Formats (vendored ``common/imatrix-loader.cpp`` and ``tools/imatrix/imatrix.cpp``):

* GGUF (current ``llama-imatrix`` output): ``general.type = "imatrix"``, ``imatrix.datasets``,
  ``imatrix.chunk_count``, ``imatrix.chunk_size``; per weight ``W`` an F32 ``W.in_sum2``
  [n_expert, ne0] (raw sums of x^2) and ``W.counts`` [n_expert, 1] (tokens seen). Normalised as
  ``sum / count``, or 1 where the count is 0 (``tools/quantize/quantize.cpp:load_imatrix``).
* legacy ``.dat``: int32 n_entries, then per entry int32 name length, name, int32 ncall, int32
  nval, nval float32 (already ``mean * ncall``), then optionally int32 chunks + dataset name.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from clef_gguf.core.errors import ConversionError

UNIFORM = "uniform"  # the --imatrix value that asks for ``uniform_for``


@dataclass
class ImportanceMatrix:
    entries: dict[str, np.ndarray]           # weight name -> float32 [ne0 * n_expert]
    datasets: list[str] = field(default_factory=list)
    chunks: int = 0
    source: str = ""                         # recorded in the quantized GGUF's metadata


def _read_gguf(path: Path) -> ImportanceMatrix:
    import gguf

    reader = gguf.GGUFReader(path, "r")
    sums, counts = {}, {}
    for t in reader.tensors:
        if t.name.endswith(".in_sum2"):
            sums[t.name[:-len(".in_sum2")]] = np.asarray(t.data, dtype=np.float32)
        elif t.name.endswith(".counts"):
            counts[t.name[:-len(".counts")]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if not sums or set(sums) != set(counts):
        raise ConversionError(f"{path} has no matching .in_sum2/.counts tensor pairs: not an imatrix GGUF")
    entries = {}
    for name, s in sums.items():
        s = s.reshape(len(counts[name]), -1)
        c = np.round(counts[name])[:, None]  # the loader rounds counts to integers
        entries[name] = np.where(c > 0, s / np.maximum(c, 1), 1.0).astype(np.float32).reshape(-1)
    f = reader.fields
    datasets = list(f["imatrix.datasets"].contents()) if "imatrix.datasets" in f else []
    chunks = int(f["imatrix.chunk_count"].contents()) if "imatrix.chunk_count" in f else 0
    return ImportanceMatrix(entries, datasets, chunks, path.name)


def _read_legacy(path: Path) -> ImportanceMatrix:
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise ConversionError(f"{path} is truncated: not a llama.cpp imatrix file")
        out = struct.unpack_from(fmt, data, pos)
        pos += size
        return out

    (n,) = take("<i")
    if n < 1 or n > 1_000_000:
        raise ConversionError(f"{path} is neither an imatrix GGUF nor a legacy imatrix .dat")
    entries = {}
    for _ in range(n):
        (length,) = take("<i")
        if not 0 < length < 4096:
            raise ConversionError(f"{path}: bad entry name length {length}: not an imatrix file")
        name = bytes(take(f"<{length}s")[0]).decode("utf-8", "replace")
        ncall, nval = take("<ii")
        if nval < 1:
            raise ConversionError(f"{path}: entry {name!r} has no values")
        values = np.frombuffer(data, np.float32, nval, pos).copy()
        pos += 4 * nval
        if pos > len(data):
            raise ConversionError(f"{path} is truncated: not a llama.cpp imatrix file")
        entries[name] = values / ncall if ncall > 0 else values
    chunks, datasets = 0, []
    if pos + 4 <= len(data):
        (chunks,) = take("<i")
        if pos + 4 <= len(data):
            (length,) = take("<i")
            if 0 < length <= len(data) - pos:
                datasets = [data[pos:pos + length].decode("utf-8", "replace")]
    return ImportanceMatrix(entries, datasets, chunks, path.name)


def read(path) -> ImportanceMatrix:
    """Load an imatrix file (GGUF or legacy) into the per-column weights the quantizer takes."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"imatrix file not found: {path}")
    with open(path, "rb") as fh:
        is_gguf = fh.read(4) == b"GGUF"
    m = _read_gguf(path) if is_gguf else _read_legacy(path)
    bad = [k for k, v in m.entries.items() if not np.isfinite(v).all()]
    if bad:  # llama.cpp would refuse too, but only after loading the whole model
        raise ConversionError(f"{path}: imatrix entry {bad[0]!r} holds non-finite values")
    return m


def write(path, m: ImportanceMatrix, *, chunk_size: int = 512) -> Path:
    """Write ``m`` in llama-imatrix's GGUF format (counts 1, so ``read`` returns the same values)."""
    return write_sums(path, m.entries, None, datasets=m.datasets or [m.source or "clef-gguf"],
                      chunks=max(m.chunks, 1), chunk_size=chunk_size)


def write_sums(path: str | Path, sums: Mapping[str, np.ndarray], counts: Mapping[str, int] | None, *,
               datasets: list[str], chunks: int, chunk_size: int) -> Path:
    """llama-imatrix's GGUF (``IMatrixCollector::save_imatrix``): ``general.type``, ``imatrix.datasets``,
    ``imatrix.chunk_count`` and ``imatrix.chunk_size``, no architecture; per weight, in name order, F32
    ``W.in_sum2`` [ne0, 1] and ``W.counts`` [1, 1] (``counts`` None: 1 each, the sums being means
    already). Whole or not at all (``hf_to_gguf.whole_gguf``): a failure leaves no half file."""
    import gguf

    from clef_gguf.convert.hf_to_gguf import whole_gguf

    path = Path(path)
    w = gguf.GGUFWriter(path=None, arch="imatrix")
    w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE)  # the writer always adds one; llama-imatrix's none
    w.add_string(gguf.Keys.General.TYPE, "imatrix")
    w.add_array("imatrix.datasets", datasets)
    w.add_uint32("imatrix.chunk_count", chunks)
    w.add_uint32("imatrix.chunk_size", chunk_size)
    payloads = []
    for name in sorted(sums):
        for suffix, value in ((".in_sum2", np.asarray(sums[name], dtype=np.float32).reshape(1, -1)),
                              (".counts", np.full((1, 1), 1 if counts is None else counts[name], dtype=np.float32))):
            w.add_tensor_info(name + suffix, value.shape, value.dtype, value.nbytes)
            payloads.append(value)
    with whole_gguf(w, path):
        for value in payloads:
            w.write_tensor_data(value)
    return path


def uniform_for(tower_gguf) -> ImportanceMatrix:
    """All-ones weights for every matrix of a tower GGUF.

    With ones, the IQ quantizers fall back to their own magnitude-based weighting
    (``sqrt(sigma2 + x^2)`` per column, ggml-quants.c): a valid file, just not the one an
    activation-aware imatrix would give. Use it when no calibration data is at hand.
    """
    from clef_gguf.formats.gguf import open_gguf

    reader = open_gguf(tower_gguf)
    entries = {}
    for t in reader.tensors:
        shape = [int(x) for x in t.shape]  # ggml order: ne0 = input columns
        if len(shape) >= 2 and t.name.endswith(".weight"):
            n_expert = shape[2] if len(shape) > 2 else 1
            entries[t.name] = np.ones(shape[0] * n_expert, dtype=np.float32)
    return ImportanceMatrix(entries, ["uniform (clef-gguf: no calibration data)"], 1,
                            "uniform (clef-gguf)")
