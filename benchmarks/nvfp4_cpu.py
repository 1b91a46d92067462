"""The nvfp4 backend on the CPU vs the GGUF path, on one random release (BENCHMARKS.md).

    python benchmarks/nvfp4_cpu.py WORKDIR [--preset tiny256] [--rounds 9]

Builds the release, converts it to f32 and Q4_K_M GGUFs and to NVFP4A16 / NVFP4 checkpoints, then
prints per model: max / mean |dp| against the f32 GGUF over the parity sample requests, and the
median (min-max) time of one decision of the longest sample request, the models taking turns.
"""

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np

from clef_gguf import Clef
from clef_gguf.convert.nvfp4 import quantize_release
from clef_gguf.convert.release import convert_release
from clef_gguf.convert.synthetic.tiny import build_release
from clef_gguf.convert.samples import SAMPLE_REQUESTS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workdir", type=Path)
    p.add_argument("--preset", default="tiny256")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    logging.disable(logging.WARNING)  # the CPU-fallback warning, once per load
    release = build_release(args.workdir / "release", preset=args.preset)
    dirs = {t: convert_release(release, args.workdir / t, outtype=t) for t in ("f32", "Q4_K_M")}
    dirs |= {s: quantize_release(release, args.workdir / s, scheme=s) for s in ("nvfp4a16", "nvfp4")}
    models = {k: Clef.load(d, state_cache_mb=0, threads=2) for k, d in dirs.items()}
    ref = [models["f32"].probabilities(r) for r in SAMPLE_REQUESTS]
    request = max(SAMPLE_REQUESTS, key=lambda r: models["f32"].prepare(r).encoded.n_tokens)
    times: dict[str, list[float]] = {k: [] for k in models}
    for m in models.values():
        m.decide(request)
    for _ in range(args.rounds):
        for k, m in models.items():
            start = time.perf_counter()
            m.decide(request)
            times[k].append((time.perf_counter() - start) * 1e3)
    for k, m in models.items():
        dp = np.concatenate([np.abs(a - b) for r, rp in zip(SAMPLE_REQUESTS, ref)
                             for a, b in zip(m.probabilities(r), rp)])
        t = times[k]
        print(json.dumps({"model": k, "tokens": m.prepare(request).encoded.n_tokens,
                          "max_abs_dp": float(dp.max()), "mean_abs_dp": float(dp.mean()),
                          "ms_median": round(statistics.median(t), 1), "ms_min": round(min(t), 1),
                          "ms_max": round(max(t), 1)}))


if __name__ == "__main__":
    main()
