"""``clef-gguf calibrate``: fit temperatures for one model and write CAL.json.

With labels: minimise the NLL of the labels. With ``--reference M0`` (labels not needed):
minimise KL(reference ‖ model), so a quant's probabilities match the full-precision model's.
A seeded share of the records is held out; the file reports NLL, ECE and Brier (and, against a
reference, mean KL) on it before and after, and is not written when the fit makes the held-out
records worse. Models run uncalibrated through eval's resumable runner (``predict``), one at a
time, in ``--work`` (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clef_gguf import __version__
from clef_gguf.pipeline import answer
from clef_gguf.core import errors
from clef_gguf.core.argtypes import fraction, non_negative_int, positive_int
from clef_gguf.evaluate import agreement, fit, metrics, predict
from clef_gguf.formats import calibration as cal
from clef_gguf.evaluate import records as labelled
from clef_gguf.bulk.job import media_policy
from clef_gguf.evaluate.cli import add_model_list, loader
from clef_gguf.formats.files import sha256_file

HOLDOUT = 0.25


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    add_model_list(p, "the model to calibrate (give it once)")
    g = p.add_argument_group("calibrate")
    g.add_argument("--data", "-d", required=True, metavar="FILE.jsonl",
                   help="records: clef-finetune's labelled JSONL; with --reference, plain "
                        "SystemOne requests are enough")
    g.add_argument("--output", "-o", required=True, metavar="CAL.json",
                   help="the calibration file to write (never overwritten)")
    g.add_argument("--reference", metavar="MODEL",
                   help="fit without labels: match this model's probabilities (e.g. the f32 or "
                        "Q8_0 build of the same release) by minimising KL(reference || model)")
    g.add_argument("--holdout", type=fraction, default=HOLDOUT, metavar="FRACTION",
                   help=f"share of the records held out to check the fit (default {HOLDOUT})")
    g.add_argument("--seed", type=non_negative_int, default=0, help="seed of the held-out split (default 0)")
    g.add_argument("--min-questions", type=positive_int, default=fit.MIN_QUESTIONS, metavar="N",
                   help="questions a band needs for a temperature of its own; fewer fall back to "
                        f"the type's, then to 1.0 (default {fit.MIN_QUESTIONS})")
    g.add_argument("--work", metavar="DIR",
                   help="keep the models' logits here (resumable); default: a temporary directory")


def split(records: Sequence[labelled.LabelledRecord], fraction: float, seed: int) -> set[int]:
    """The line numbers held out: a seeded share of the records, at least one."""
    order = np.random.default_rng(seed).permutation(len(records))
    n = max(1, int(round(fraction * len(records))))
    return {records[i].index for i in order[:n]}


def items(lines: Sequence[dict[str, Any]], reference: dict[str, dict[str, Any]] | None) -> list[fit.Item]:
    """One fit item per labelled question (label mode) or per question the reference answered."""
    out = []
    for line in lines:
        targets = line.get("targets", {})
        ref_q = reference.get(line["id"], {}) if reference is not None else {}
        for qid, q in line.get("questions", {}).items():
            z = np.asarray(q["logits"], dtype=np.float64)
            if reference is not None:
                r = ref_q.get(qid)
                if r is not None and r["option_ids"] == q["option_ids"]:
                    out.append(fit.Item(q["type"], z, reference=np.asarray(r["probs"], dtype=np.float64)))
            elif qid in targets:
                out.append(fit.Item(q["type"], z, target=int(targets[qid])))
    return out


def recalibrated(lines: Sequence[dict[str, Any]], calibration: cal.Calibration | None
                 ) -> list[dict[str, Any]]:
    """``lines`` with each question's probabilities as the runtime computes them under
    ``calibration`` (None: T = 1)."""
    out = []
    for line in lines:
        questions = {}
        for qid, q in line.get("questions", {}).items():
            t = 1.0 if calibration is None else calibration.temperature(q["type"], len(q["logits"]))
            probs = answer.split_probabilities(np.asarray(q["logits"], dtype=np.float32),
                                               (len(q["logits"]),), (t,))[0]
            questions[qid] = q | {"probs": probs.tolist()}
        out.append(line | {"questions": questions})
    return out


def scores(lines: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
    rows = predict.prediction_rows(list(lines))
    out: dict[str, Any] = {"questions": sum(len(line.get("questions", {})) for line in lines)}
    if rows:
        block = metrics.block(rows)
        out |= {"labelled": len(rows), "nll": block["nll"], "ece": block["ece"], "brier": block["brier"]}
    if reference is not None:
        out["mean_kl"] = agreement.compare(reference, lines)["overall"].get("mean_kl")
    return out


def run_calibrate(args: argparse.Namespace) -> int:
    if len(args.model) != 1:
        raise errors.InvalidValue("calibrate fits one model: give --model once", field="model")
    if args.calibration:
        raise errors.InvalidValue("calibrate fits the raw model: leave --calibration out",
                                  field="calibration")
    target = Path(args.output)
    if target.exists():
        raise errors.InvalidValue(f"{target} exists: a calibration file is never overwritten, "
                                  "give another --output", field="output")
    data = Path(args.data)
    records = list(labelled.read(data))
    if len(records) < 2:
        raise errors.InvalidInput(f"{data} needs at least 2 records (one to fit, one to check)",
                                  field="data")
    held = split(records, args.holdout, args.seed)
    with tempfile.TemporaryDirectory(prefix="clef-calibrate-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        identity = {"format": "clef-gguf-calibrate/1", "data_sha256": sha256_file(data),
                    "records": len(records), "calibration": "none", "max_length": args.max_length,
                    "truncate_state": False}
        model, pictures = args.model[0], media_policy(data)
        run = predict.run_model(loader(args, model, None), records, work / "model", label=model,
                                identity=identity | {"model": model}, with_binding=True,
                                media_policy=pictures)
        ref = None
        if args.reference:
            ref = predict.run_model(loader(args, args.reference, None), records,
                                    work / "reference", label=args.reference,
                                    identity=identity | {"model": args.reference}, media_policy=pictures)
        body = fitted(run, ref, held, args, data, len(records))
    calibration = cal.Calibration.build(body)
    calibration.write(target)
    report = body["fit"]["holdout"]
    print(json.dumps({"version": calibration.version, "output": str(target),
                      "temperatures": {k: v["temperature"] for k, v in body["temperatures"].items()},
                      "holdout": report}, indent=2))
    print(f"calibration {calibration.version} written to {target}", file=sys.stderr)
    return 0


def fitted(run: predict.ModelRun, ref: predict.ModelRun | None, held: set[int],
           args: argparse.Namespace, data: Path, n_records: int) -> dict[str, Any]:
    """The calibration file's fields: the table fitted on the kept records, checked on the held
    out ones (CalibrationNotBetter when they get worse)."""
    ref_lines = None if ref is None else ref.lines
    fit_lines = [line for line in run.lines if int(line["id"]) not in held]
    check_lines = [line for line in run.lines if int(line["id"]) in held]
    reference = None if ref_lines is None else {line["id"]: line.get("questions", {}) for line in ref_lines}
    fit_items = items(fit_lines, reference)
    if not fit_items:
        raise errors.InvalidInput("no question to fit on: the records need labels (or give "
                                  "--reference)", field="data")
    table = fit.fit_table(fit_items, args.min_questions)
    probe = cal.Calibration.build({"bound_to": run.info["binding"], "temperatures": table})
    ref_check = None if ref_lines is None else [line for line in ref_lines if int(line["id"]) in held]
    before = scores(recalibrated(check_lines, None), ref_check)
    after = scores(recalibrated(check_lines, probe), ref_check)
    key = "mean_kl" if ref_lines is not None else "nll"
    if before.get(key) is None:
        raise errors.InvalidInput(f"the held-out records hold no {'question' if ref_lines else 'label'} "
                                  "to check the fit on: give more records or a larger --holdout",
                                  field="data")
    if after[key] > before[key]:
        raise errors.CalibrationNotBetter(
            f"the fitted temperatures make the held-out {key} worse ({before[key]:.6f} -> "
            f"{after[key]:.6f}): no file written", field="data")
    return {"bound_to": run.info["binding"], "temperatures": table, "created_by": f"clef-gguf {__version__}",
            "fit": {"method": "kl" if ref_lines is not None else "nll",
                    "reference": None if ref is None else {
                        "model": args.reference, "model_hash": ref.info.get("model_hash")},
                    "data": data.name, "data_sha256": sha256_file(data), "records": n_records,
                    "fit_items": len(fit_items), "min_questions": args.min_questions,
                    "bounds": list(fit.BOUNDS),
                    "holdout": {"fraction": args.holdout, "seed": args.seed, "records": len(held),
                                "before": before, "after": after}}}
