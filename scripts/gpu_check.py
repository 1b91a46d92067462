"""Decide on the tiny demo model with every layer on the GPU and on the CPU; print max |dp|.

Run by scripts/gpu-check.sh on a CUDA machine. Exit 1 when the build has no GPU backend, the GPU
run did not offload, or the two disagree by more than 1e-3 (f32 tower: kernels differ, not maths).
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from clef_gguf import Clef
from clef_gguf.convert.release import convert_release
from clef_gguf.convert.tiny import build_release
from clef_gguf.models import machine

REQUESTS = [
    {"state": "Invoice INV-7 for $1,250.00 is 40 days past due.",
     "questions": {"overdue": {"type": "noul"},
                   "action": {"type": "choice", "criteria": {"remind": None, "escalate": None}},
                   "risk": {"type": "score", "criteria": ["low", "medium", "high"]}}},
    {"state": {"ticket": "refund not received", "days": 14} | {f"k{i}": i for i in range(200)},
     "questions": {"urgent": {"type": "noul"}}},
]


def main() -> int:
    backends = machine.llama_backends()
    with tempfile.TemporaryDirectory() as tmp:
        model = convert_release(build_release(Path(tmp) / "rel"), Path(tmp) / "m", outtype="f32")
        runs = {}
        for name, layers in (("cpu", 0), ("gpu", "all")):
            with Clef.load(model, gpu_layers=layers, state_cache_mb=0) as clef:
                start = time.perf_counter()
                probs = [np.concatenate(clef.probabilities(r)) for r in REQUESTS]
                runs[name] = (clef.info["gpu_layers"], probs, time.perf_counter() - start)
    dp = max(float(np.abs(a - b).max()) for a, b in zip(runs["cpu"][1], runs["gpu"][1]))
    report = {"backends": backends, "gpu_layers": runs["gpu"][0], "max_abs_dp": dp,
              "seconds": {k: round(v[2], 3) for k, v in runs.items()}}
    print(json.dumps(report))
    ok = bool(backends) and runs["gpu"][0] == -1 and dp <= 1e-3
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
