"""Predicted vs measured: ``pick``'s speed probe against whole decisions of real model files.

    python scripts/speed_check.py MODEL_DIR [MODEL_DIR ...] --preset flash9b [--tokens 500] [--repeat 2]
    python scripts/speed_check.py --small-set WORKDIR [--types Q8_0,Q4_K_M]   # every type, ~110M model
    python scripts/speed_check.py NVFP4_GGUF_DIR --preset small --probe-quant NVFP4A16-GGUF

Each MODEL_DIR is a random model of the preset's shape in one quant (``python -m clef_gguf.convert.synthetic.big
DIR --outtype Q4_K_M``; ``--preset small`` for the ~110M shape). Per model, in this one process and
alternating ``--repeat`` times: the measured decision (``Clef.load`` with the state cache off, bench's
request of about ``--tokens`` tokens, the median of 3 after a warm-up) and the probe's prediction for
the same tokens decoded (``speed.measure(..., reprobe=True)``: a fresh probe each time). Prints one JSON
report: per quant, measured and predicted seconds and the ratio predicted / measured (median, min-max).
``--small-set WORKDIR`` first makes the ~110M ``small`` model in every published type (as
``scripts/eval_quants.py`` makes them: seeded release, f32 conversion, llama.cpp's quantizer with a
uniform importance matrix; resumable) and checks each against the probe at the ``small`` preset.
Random weights: evidence about time only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from clef_gguf import Clef
from clef_gguf.core.limits import SYSTEM_PREFIX_TOKENS
from clef_gguf.pick import speed
from clef_gguf.tools.workload import sized_request


def decision_seconds(clef: Clef, request: dict, runs: int = 3) -> list[float]:
    prepared = clef.prepare(request)
    clef.run(prepared)  # warm-up: the prefix snapshot, the mmap paged in
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        clef.run(clef.prepare(request))
        out.append(time.perf_counter() - start)
    return out


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def check(model: str, preset: str, tokens: int, threads: int, repeat: int, probe_quant: str | None = None) -> dict:
    clef = Clef.load(model, threads=threads, state_cache_mb=0)
    try:
        quant = (probe_quant or str(clef.info["quant"])).upper()
        request = sized_request(clef, tokens)
        encoded = clef.prepare(request).encoded
        decoded = encoded.n_tokens - encoded.prefix_tokens  # what each decision after the first decodes
        measured, predicted = [], []
        for _ in range(repeat):
            measured.append(statistics.median(decision_seconds(clef, request)))
            table = speed.measure("clef-flash", [quant], tokens=decoded + SYSTEM_PREFIX_TOKENS, threads=threads,
                                  reprobe=True, preset=preset)
            row = table.quants[quant]
            if row.error:
                return {"model": model, "quant": quant, "error": row.error}
            predicted.append(row.seconds)
    finally:
        clef.close()
    ratios = [p / m for p, m in zip(predicted, measured)]
    return {"model": model, "quant": quant, "prompt_tokens": encoded.n_tokens, "decoded_tokens": decoded,
            "measured_s": spread(measured), "predicted_s": spread(predicted), "ratio": spread(ratios),
            "within_25_percent": all(0.75 <= r <= 1.25 for r in ratios)}


def small_set(work: Path, types: list[str], threads: int) -> list[str]:
    """The ~110M model in each of ``types`` under ``work`` (made once), as eval_quants.py makes them."""
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.synthetic.tiny import build_release
    from clef_gguf.tools.quant_table import make_model

    work.mkdir(parents=True, exist_ok=True)
    release, base = work / "release", work / "model-f32"
    if not release.exists():
        build_release(release, preset="small", seed=0)
    if not base.exists():
        convert_release(release, base, outtype="f32", name="clef-small-random")
    out = []
    for qtype in types:
        model = work / f"model-{qtype}"
        if not model.exists():
            make_model(base, release, qtype, model, imatrix="uniform", threads=threads)
        out.append(str(model))
    return out


def main(argv: list[str] | None = None) -> int:
    from clef_gguf.convert.quantize import PUBLISHED

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="model directories of the preset's shape, one quant each")
    ap.add_argument("--small-set", type=Path, metavar="WORKDIR",
                    help="make the ~110M model in every type (--types) here and check each (--preset small)")
    ap.add_argument("--types", default=",".join(q for q in PUBLISHED if q != "BF16"),
                    help="with --small-set: comma-separated types (default: every published quant)")
    ap.add_argument("--preset", default="flash9b", help="convert.synthetic.big preset the models have (flash9b, small)")
    ap.add_argument("--tokens", type=int, default=speed.DEFAULT_TOKENS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="measured/predicted pairs per model (default 2)")
    ap.add_argument("--probe-quant", metavar="Q",
                    help="the probe's name for the models' type when it is not their quant: NVFP4A16-GGUF or "
                         "NVFP4-GGUF for an NVFP4 checkpoint's GGUF (convert CHECKPOINT OUT)")
    args = ap.parse_args(argv)
    models = list(args.models)
    if args.small_set:
        args.preset = "small"
        models += small_set(args.small_set, args.types.split(","), args.threads)
    if not models:
        ap.error("give model directories or --small-set WORKDIR")
    rows = []
    for m in models:
        rows.append(check(m, args.preset, args.tokens, args.threads, args.repeat, args.probe_quant))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"preset": args.preset, "tokens": args.tokens, "threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
