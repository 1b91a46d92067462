"""The GPU check's rows in priority order (``run`` runs each in a process group of its own, in this
order), each with its planned cost: seconds on a 16-core GPU host, model writing included (estimates
until a GPU run replaces them; docs/gpu.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpu_check import common, nvfp4


@dataclass(frozen=True)
class Row:
    """A row: its function, its planned seconds on a 16-core GPU host (models written in the run
    included), and whether it runs after the deadline of the others, on a budget of its own."""

    name: str
    fn: Callable[[Path, bool], dict]
    cost_s: float
    after_deadline: bool = False


ROWS: tuple[Row, ...] = (  # in priority order
    Row("preflight", common.preflight, 15),
    Row("parity", common.parity, 30),
    Row("latency", common.latency, 75),  # the 9B Q4_K_M written (~20 s), loaded, 2 lengths x 6 decisions
    Row("throughput", common.throughput, 120),
    Row("pick", common.pick, 60),
    Row("nvfp4", nvfp4.nvfp4, 150),  # one checkpoint three ways, and the PyTorch backend like for like
    Row("kernels", common.kernels, 180, after_deadline=True),
)
