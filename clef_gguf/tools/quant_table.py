"""``clef-gguf quant-table``: agreement of every quant type with the transformers reference.

For one Hugging Face release (``--release DIR``, or ``--demo``: the random ``tiny256`` release,
hidden 256 so every K-/IQ-quant block fits), convert once to a lossless base (bf16 for a bf16
checkpoint, else f32), make each type from it (BF16/q8_0 by the converter, the rest by llama.cpp's
quantizer), decide the sample requests with each, and compare the probabilities with the
reference's (``parity.compare``, the function ``parity.run_parity`` uses; the reference side runs
once, not once per type). Output: a Markdown table (type, tower file size, ``output.weight``
type, importance matrix, max and mean |dp|, argmax agreement).

On the demo model the numbers show that each quant path is wired correctly and how its
error ranks, nothing more: random weights are not Clef-Flash's weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from clef_gguf.core.argtypes import positive_int
from clef_gguf.core import errors
from clef_gguf.core.limits import KiB, MiB
from clef_gguf.convert.samples import SAMPLE_REQUESTS
from clef_gguf.tools import parity

DEMO_PRESET, DEMO_SEED = "tiny256", 0
LABEL = ("**Tiny random model measurements, not a quality claim about Clef-Flash.** The weights are seeded "
         "noise; the table shows that every quant path converts, loads and decides, and how far each "
         "type moves the answers of *this* toy model.")


def _size(n: int) -> str:
    return f"{n / MiB:.2f} MiB" if n >= MiB else f"{n / KiB:.0f} KiB"


def make_model(base: Path, release: Path, qtype: str, out: Path, *, imatrix=None,
               threads: int | None = None) -> Path:
    """The model directory for ``qtype`` (published spelling) made from ``base``/``release``."""
    from clef_gguf.convert import quantize
    from clef_gguf.convert.release import convert_release

    outtype = quantize.canonical_outtype(qtype)
    if outtype in quantize.DIRECT_TYPES:
        return convert_release(release, out, outtype=outtype, name=f"{release.name}")
    return quantize.quantize_model(base, out, outtype, imatrix=imatrix_for(outtype, imatrix),
                                   threads=threads)


def imatrix_for(outtype: str, imatrix):
    """A real (calibrated) matrix helps every llama.cpp type; the flat one only where required."""
    from clef_gguf.convert import quantize

    if outtype.lower() in quantize.DIRECT_TYPES or imatrix is None:
        return None
    if imatrix == "uniform" and outtype.upper() not in quantize.NEEDS_IMATRIX:
        return None
    return imatrix


def measure(release: Path, types: list[str], workdir: Path, *, requests: list[dict],
            imatrix="uniform", threads: int | None = None, reference_dtype: str = "f32",
            keep: bool = False, log=print) -> list[dict]:
    """One row per type, in order; model directories go under ``workdir``."""
    from clef_gguf.convert import quantize
    from clef_gguf.convert.release import convert_release, intermediate_type
    from clef_gguf.runtime.model import Clef

    reference = parity.Reference(release, dtype=reference_dtype)
    ref = [reference.probabilities(r) for r in requests]
    del reference  # the transformers model can be as large as the tower: free it before the loop
    base_type = intermediate_type(release)
    base = convert_release(release, workdir / f"base-{base_type}", outtype=base_type)
    rows = []
    for qtype in types:
        start = time.perf_counter()
        out = workdir / f"model-{qtype}"
        model = base if qtype.lower() == base_type else make_model(base, release, qtype, out,
                                                                   imatrix=imatrix, threads=threads)
        with Clef.load(model, threads=threads) as clef:
            ours = [clef.probabilities(r) for r in requests]
            info = dict(clef.info)
            tower = clef.files.tower
        report = parity.compare(ours, ref, model=f"{info['name']}:{qtype}")
        used = imatrix_for(quantize.canonical_outtype(qtype), imatrix)
        rows.append({"type": qtype, "file_bytes": tower.stat().st_size,
                     "output_weight": info["lexical_rows"],
                     "imatrix": "-" if used is None else used if used == "uniform" else Path(used).name,
                     **{k: v for k, v in report.to_dict().items() if k != "near_ties"},
                     "seconds": round(time.perf_counter() - start, 2)})
        log(f"quant-table: {qtype:8s} max|dp| {report.max_abs_dp:.3g}  argmax "
            f"{report.argmax_agree}/{report.argmax_checked}  ({rows[-1]['seconds']}s)")
        if not keep and model != base:
            shutil.rmtree(model, ignore_errors=True)
    return rows


def markdown(rows: list[dict], *, title: str, notes: list[str]) -> str:
    head = ["| type | tower file | output.weight | imatrix | max \\|Δp\\| | mean \\|Δp\\| | argmax agreement |",
            "|---|---:|---|---|---:|---:|---:|"]
    body = [f"| {r['type']} | {_size(r['file_bytes'])} | {r['output_weight']} | {r['imatrix']} | "
            f"{r['max_abs_dp']:.2e} | {r['mean_abs_dp']:.2e} | {r['argmax_agree']}/{r['argmax_checked']} |"
            for r in rows]
    return "\n".join([f"# {title}", "", *notes, "", *head, *body, ""])


def add_arguments(p: argparse.ArgumentParser) -> None:
    from clef_gguf.convert.quantize import PUBLISHED

    src = p.add_mutually_exclusive_group()
    src.add_argument("--release", help="a Hugging Face Clef release directory (real weights)")
    src.add_argument("--demo", action="store_true",
                     help=f"use the random {DEMO_PRESET} release (seed {DEMO_SEED}; the default "
                          "without --release); no download")
    p.add_argument("--types", default=",".join(PUBLISHED),
                   help="comma-separated types (default: all 30 published; add f32 for the "
                        "converter's own error, which --demo always shows first)")
    p.add_argument("--imatrix", default="uniform", metavar="FILE|uniform",
                   help="importance matrix: a llama-imatrix file is used for every llama.cpp "
                        "type; the default, uniform (flat weights), only for the types llama.cpp "
                        "refuses without one")
    p.add_argument("--workdir", help="where the models are built (default: a temp dir; needs room "
                   "for the base conversion plus one quant at a time)")
    p.add_argument("--keep", action="store_true", help="keep every converted model in --workdir")
    p.add_argument("--requests", help="JSON list of requests (default: parity's samples)")
    p.add_argument("--reference-dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--write", metavar="FILE.md", help="write the Markdown here instead of stdout")
    p.add_argument("--json", metavar="FILE", help="also write the raw rows as JSON")


def run(args: argparse.Namespace) -> int:
    import llama_cpp

    from clef_gguf.runtime.flags import read_request
    from clef_gguf.convert.quantize import canonical_outtype

    demo = args.demo or not args.release
    # Published spelling for the table (BF16, Q8_0, Q4_K_M); f32/f16 stay lower case.
    types = [canonical_outtype(t).upper() if canonical_outtype(t) not in ("f32", "f16")
             else canonical_outtype(t) for t in args.types.split(",") if t.strip()]
    if demo and "f32" not in [t.lower() for t in types]:
        types.insert(0, "f32")  # the converter's own error: the floor every quant adds to
    requests = read_request(args.requests) if args.requests else SAMPLE_REQUESTS
    if not isinstance(requests, list) or not requests:
        raise errors.InvalidValue("--requests must hold a non-empty JSON list", field="requests")
    with tempfile.TemporaryDirectory(prefix="clef-quant-table-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if demo:
            from clef_gguf.convert.synthetic.tiny import build_release

            release = build_release(workdir / "release", preset=DEMO_PRESET, seed=DEMO_SEED)
        else:
            release = Path(args.release)
        start = time.perf_counter()
        rows = measure(release, types, workdir, requests=requests, imatrix=args.imatrix,
                       threads=args.threads, reference_dtype=args.reference_dtype, keep=args.keep,
                       log=lambda line: print(line, file=sys.stderr))
        seconds = time.perf_counter() - start
    n_q = rows[0]["questions"]
    n_opt = rows[0]["options"]
    what = (f"the random `{DEMO_PRESET}` release (seed {DEMO_SEED}: hidden 256, 4 layers, vocab 768)"
            if demo else f"the release `{release.name}`")
    notes = ([LABEL, ""] if demo else []) + [
        f"Model: {what}. Each type's tower decides {len(requests)} requests ({n_q} questions, "
        f"{n_opt} options); Δp is its probability minus the transformers {args.reference_dtype} "
        "reference's, over every option. Argmax agreement counts questions whose reference top-2 "
        "margin exceeds 0.01."
        + (" The f32 row is the converter's own error." if "f32" in [r["type"] for r in rows] else "")
        + (f" With only {n_q} questions, neighbouring types trade places by chance: read the table "
           "as 'every type works, and error grows as bits shrink', not as a ranking." if demo else ""),
        "",
        ("Types that llama.cpp refuses without an importance matrix used a uniform one (flat "
         "weights" + (": no calibration data exists for random weights" if demo else "")
         + "); all others none." if args.imatrix == "uniform" else
         f"Every llama.cpp type used the importance matrix `{Path(args.imatrix).name}`.")
        + " `output.weight` is the type of the lexical rows.",
        "",
        f"Generated by `clef-gguf quant-table {'--demo' if demo else '--release ' + release.name}` "
        f"with llama-cpp-python {llama_cpp.__version__} in {seconds:.0f} s.",
    ]
    title = "Quant agreement: " + ("tiny random model" if demo else release.name)
    text = markdown(rows, title=title, notes=notes)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(text)
        print(json.dumps({"written": args.write, "types": len(rows)}))
    else:
        print(text)
    return 0
