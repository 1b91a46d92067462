"""Measurements a busy machine spoiled, told by their neighbours: a quant out of line with its kernel
group is measured again (``speed.measure``), and of two measurements of one quant the quieter is kept.

How busy the machine was while each was taken is ``core.load``'s measure (a ``Window`` per quant).
"""

from __future__ import annotations

import statistics

# Types whose matmuls take the same kind of CPU kernel (ggml's per-block dot products): within a group a
# quant's time follows its bytes within a few percent, across groups it does not (the probe's table in
# docs/models.md). Absent: a K-quant is "k", another IQ type "iq", anything else its own group.
# The two NVFP4 GGUFs hold the same tensor types (off Blackwell, the same 8-bit-activation dot products).
KERNEL_GROUPS = {"Q4_0": "q_0", "Q5_0": "q_0", "Q8_0": "q_0", "IQ4_NL": "q_0", "Q4_1": "q_1", "Q5_1": "q_1",
                 "NVFP4A16-GGUF": "nvfp4", "NVFP4-GGUF": "nvfp4"}
# A quant this many times its group's median (the others') is out of line: measured again. Far above the
# few percent a group spreads over on a quiet machine, far below what another process's load makes of it.
OUT_OF_LINE = 1.5


def kernel_group(quant: str) -> str:
    """The kind of CPU kernel ``quant``'s matmuls take (``KERNEL_GROUPS``)."""
    q = quant.upper()
    return KERNEL_GROUPS.get(q) or ("k" if "_K" in q else "iq" if q.startswith("IQ") else q)


def out_of_line(seconds: dict[str, float]) -> set[str]:
    """Quants more than ``OUT_OF_LINE`` times the median of the others of their kernel group."""
    groups: dict[str, list[str]] = {}
    for q in seconds:
        groups.setdefault(kernel_group(q), []).append(q)
    out = set()
    for members in groups.values():
        for q in members:
            others = [seconds[o] for o in members if o != q]
            if others and seconds[q] > OUT_OF_LINE * statistics.median(others):
                out.add(q)
    return out


def _pace(row: dict) -> float:
    """Seconds per token of a measurement's fastest run."""
    return min(row["probe_runs"]) / row["probe_tokens"]


def kept(first: dict, again: dict | None) -> dict:
    """Of two measurements of one quant (``speed_run``'s rows with their window's ``loaded``), the one
    taken without load, else the faster."""
    if again is None or "error" in again:
        return first
    if "error" in first:
        return {**again, "remeasured": True}
    best = min((first, again), key=lambda r: (r["loaded"], _pace(r)))
    return {**best, "remeasured": True}
