"""Decide on the tiny demo model with every layer on the GPU and on the CPU; print max |dp|.

Run by scripts/gpu-check.sh on a CUDA machine. Exit 1 when the build has no GPU backend, the GPU
run did not offload, or the two disagree by more than 1e-3 (f32 tower: kernels differ, not maths).

``--speed`` (gpu-check.sh passes it): also ``pick``'s speed probe with its layers on the GPU, as the
runtime places a file that fits, against a measured decision of a random 9B-shaped Q4_K_M model
(``convert.big``, ~6 GB, built here) on the GPU: ``speed.ratio`` is predicted / measured (the CPU
goal is within 25%; exit 1 outside 0.5-2, a probe that does not see the GPU at all).
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from clef_gguf import Clef
from clef_gguf.convert.release import convert_release
from clef_gguf.convert.synthetic.tiny import build_release
from clef_gguf.models import machine

REQUESTS = [
    {"state": "Invoice INV-7 for $1,250.00 is 40 days past due.",
     "questions": {"overdue": {"type": "noul"},
                   "action": {"type": "choice", "criteria": {"remind": None, "escalate": None}},
                   "risk": {"type": "score", "criteria": ["low", "medium", "high"]}}},
    {"state": {"ticket": "refund not received", "days": 14} | {f"k{i}": i for i in range(200)},
     "questions": {"urgent": {"type": "noul"}}},
]


def speed_on_gpu(work: Path) -> dict:
    """pick's probe on the GPU vs a decision measured there (scripts/speed_check.py's measurement)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from speed_check import decision_seconds

    from clef_gguf.convert.synthetic.big import build_random_model
    from clef_gguf.core.cpus import available_cpus
    from clef_gguf.core.limits import SYSTEM_PREFIX_TOKENS
    from clef_gguf.pick import speed
    from clef_gguf.tools.bench import sized_request

    model = work / "flash9b-Q4_K_M"
    build_random_model(model, outtype="Q4_K_M")
    with Clef.load(model, gpu_layers="all", state_cache_mb=0) as clef:
        request = sized_request(clef, speed.DEFAULT_TOKENS)
        encoded = clef.prepare(request).encoded
        measured = statistics.median(decision_seconds(clef, request))
    decoded = encoded.n_tokens - encoded.prefix_tokens
    table = speed.measure("clef-flash", ["Q4_K_M"], tokens=decoded + SYSTEM_PREFIX_TOKENS,
                          threads=available_cpus(), gpu_layers={"Q4_K_M": -1}, reprobe=True)
    row = table.quants["Q4_K_M"]
    return {"measured_s": round(measured, 3), "predicted_s": row.seconds, "error": row.error,
            "ratio": round(row.seconds / measured, 3) if row.seconds else None, "probe_s": table.took_seconds}


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
    if "--speed" in sys.argv[1:] and backends:
        with tempfile.TemporaryDirectory() as tmp:
            report["speed"] = speed_on_gpu(Path(tmp))
        print(json.dumps(report))
        ok = ok and report["speed"]["ratio"] is not None and 0.5 <= report["speed"]["ratio"] <= 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
