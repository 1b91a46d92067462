"""Every published quant type of the ~110M random model against its f32, side by side with
``clef-gguf eval``: agreement, mean KL, size and records/s on this machine.

    python scripts/eval_quants.py WORKDIR [--records 60] [--threads 2] [--types Q8_0,Q4_K_M]

Builds the ``small`` demo release (hidden 512, 12 layers; seeded random weights) in WORKDIR, its
f32 conversion and one model per type (as ``clef-gguf quant-table`` makes them), writes
WORKDIR/requests.jsonl (the demo requests, no labels: agreement needs none), and runs one eval with
f32 first, into WORKDIR/eval (report.md, summary.json, tradeoff.png). Rerunning resumes. Random
weights: evidence about quantization noise, not about Clef-Flash. Several minutes per type on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PRESET, SEED = "small", 0


def main(argv: list[str] | None = None) -> int:
    from clef_gguf.cli import main as clef_gguf
    from clef_gguf.convert.quantize import PUBLISHED
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.synthetic.tiny import build_release
    from clef_gguf.evaluate import demo
    from clef_gguf.tools.quant_table import make_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workdir", type=Path)
    p.add_argument("--records", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--types", default=",".join(PUBLISHED), help="comma-separated (default: all published)")
    p.add_argument("--plots", action="store_true", help="also tradeoff.png (needs matplotlib)")
    args = p.parse_args(argv)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    release = work / "release"
    if not release.exists():
        build_release(release, preset=PRESET, seed=SEED)
    base = work / "model-f32"
    if not base.exists():
        convert_release(release, base, outtype="f32", name=f"clef-{PRESET}-random")
    models = [base]
    for qtype in args.types.split(","):
        out = work / f"model-{qtype}"
        if not out.exists():
            print(f"eval_quants: making {qtype}", file=sys.stderr, flush=True)
            make_model(base, release, qtype, out, imatrix="uniform", threads=args.threads)
        models.append(out)
    requests = work / "requests.jsonl"
    if not requests.exists():
        requests.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "id"}) + "\n"
                                    for r in demo.requests(args.records, seed=SEED)))
    argv_eval = ["eval", "--data", str(requests), "--output", str(work / "eval"), "--threads", str(args.threads)]
    for m in models:
        argv_eval += ["--model", str(m)]
    return clef_gguf(argv_eval + (["--plots"] if args.plots else []))


if __name__ == "__main__":
    sys.exit(main())
