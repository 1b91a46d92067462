"""The nvfp4 backend on the CPU vs the GGUF path, on one random release (BENCHMARKS.md, docs/nvfp4.md).

    python benchmarks/nvfp4_cpu.py WORKDIR [--preset tiny256] [--rounds 9]

Builds the release, converts it to f32 and Q4_K_M GGUFs and to NVFP4A16 / NVFP4 checkpoints, and
re-encodes both checkpoints as NVFP4 GGUFs (``convert.nvfp4_to_gguf``), then prints per model: max / mean
|dp| against the f32 GGUF over the parity sample requests (and, for an NVFP4 GGUF, against the PyTorch
backend on the same checkpoint), and the median (min-max) time of one decision of the longest sample
request, the models taking turns, with its ratio to Q4_K_M's.
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
from clef_gguf.convert.nvfp4_to_gguf import convert_checkpoint
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
    dirs |= {f"{s}-gguf": convert_checkpoint(dirs[s], args.workdir / f"{s}-gguf") for s in ("nvfp4a16", "nvfp4")}
    models = {k: Clef.load(d, state_cache_mb=0, threads=2) for k, d in dirs.items()}
    request = max(SAMPLE_REQUESTS, key=lambda r: models["f32"].prepare(r).encoded.n_tokens)
    times: dict[str, list[float]] = {k: [] for k in models}
    for m in models.values():
        m.decide(request)
    for _ in range(args.rounds):
        for k, m in models.items():
            start = time.perf_counter()
            m.decide(request)
            times[k].append((time.perf_counter() - start) * 1e3)
    probs = {k: [m.probabilities(r) for r in SAMPLE_REQUESTS] for k, m in models.items()}

    def dp(a: str, b: str) -> np.ndarray:
        return np.concatenate([np.abs(x - y) for pa, pb in zip(probs[a], probs[b]) for x, y in zip(pa, pb)])

    q4 = statistics.median(times["Q4_K_M"])
    for k, m in models.items():
        t, vs_f32 = times[k], dp(k, "f32")
        row = {"model": k, "tokens": m.prepare(request).encoded.n_tokens,
               "max_abs_dp": float(vs_f32.max()), "mean_abs_dp": float(vs_f32.mean()),
               "ms_median": round(statistics.median(t), 1), "ms_min": round(min(t), 1),
               "ms_max": round(max(t), 1), "vs_q4_k_m": round(statistics.median(t) / q4, 2)}
        if k.endswith("-gguf"):  # the same checkpoint through the PyTorch backend
            vs_torch = dp(k, k.removesuffix("-gguf"))
            row |= {"max_abs_dp_vs_pytorch": float(vs_torch.max()), "mean_abs_dp_vs_pytorch": float(vs_torch.mean())}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
