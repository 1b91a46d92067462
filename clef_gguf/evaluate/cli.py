"""``clef-gguf eval``: metrics of one or more models on labelled records, side by side.

One model writes ``DIR/predictions.jsonl`` (clef-finetune's rows), ``DIR/metrics.json``
(clef-finetune's ``summarize`` plus ``per_type``, ``reliability`` and record counts),
``DIR/errors.jsonl``, ``DIR/summary.json`` and ``DIR/report.md``. Several models (the first is the
reference) each get those files in ``DIR/<model>/``, loaded one at a time, and the top level gets
the comparison: ``summary.json``, ``report.md`` and, with ``--plots``, ``reliability.png`` and
``tradeoff.png``. Rerunning the same command resumes: finished models are not loaded again.
A Decision Index suite file (``evaluate.suite``) adds the per-benchmark table (``evaluate.decision_index``)
to both, and ``benchmarks.png``; ``--quants`` names the models as quants of one family or directory.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from clef_gguf.bulk.job import media_policy
from clef_gguf.core import errors
from clef_gguf.core.argtypes import non_negative_int, positive_int
from clef_gguf.runtime.flags import add_model_arguments, load_model
from clef_gguf.evaluate import agreement, decision_index, demo, metrics, plots, predict, report, stats, suite
from clef_gguf.evaluate import records as labelled
from clef_gguf.formats.files import sha256_file
from clef_gguf.runtime.model import Clef
from clef_gguf.runtime.registry import Models

EVAL_FORMAT = "clef-gguf-eval/1"
DEFAULT_FAMILY = "clef-flash"


def add_model_list(p: argparse.ArgumentParser, what: str, *, required: bool = True) -> None:
    """The shared model flags, with ``--model`` (and ``--calibration``) given once per model."""
    add_model_arguments(p)
    # the two flags below replace the shared single-model ones
    g = p.add_argument_group("models", conflict_handler="resolve")
    g.add_argument("--model", "-m", action="append", required=required, metavar="MODEL",
                   help=f"{what}: a converted model directory, a .gguf next to its head files, "
                        "or a catalog name such as clef-flash:Q4_K_M")
    g.add_argument("--calibration", action="append", metavar="CAL.json",
                   help="a `clef-gguf calibrate` file to apply: once for every model, or once "
                        "per --model in the same order (none: no calibration for that model)")


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    add_model_list(p, "the model to evaluate; give --model several times to compare quants side "
                      "by side (the first is the reference; they are loaded one at a time)", required=False)
    p.add_argument("rows", nargs="?", metavar="ROWS",
                   help="the data, as --data: a Decision Index suite file (selected-rows.jsonl.gz, "
                        "added-rows.jsonl.gz or its rows as .jsonl) or clef-finetune's JSONL")
    g = p.add_argument_group("eval")
    g.add_argument("--data", "-d", metavar="FILE.jsonl",
                   help="labelled records: clef-finetune's JSONL (a SystemOne request per line "
                        "plus \"labels\": {question_id: label}), or a Decision Index suite file (per "
                        "benchmark: accuracy, macro-F1, case-exact, coverage); without labels, "
                        "agreement between models is still measured")
    g.add_argument("--quants", type=quant_list, metavar="Q8_0,Q6_K,...",
                   help="compare these quants of one --model side by side, the first as the reference: "
                        f"a catalog family (default {DEFAULT_FAMILY}: {DEFAULT_FAMILY}:Q8_0, ...) or a "
                        "directory holding one .gguf per quant next to the head files")
    g.add_argument("--output", "-o", required=True, metavar="DIR",
                   help="where the predictions, metrics and report go; an existing DIR of the "
                        "same command is resumed")
    g.add_argument("--json", action="store_true", help="print summary.json instead of a table")
    g.add_argument("--plots", action="store_true",
                   help="also write reliability.png and tradeoff.png (needs matplotlib: pip "
                        "install 'clef-gguf[eval]')")
    g.add_argument("--seed", type=non_negative_int, default=0, help="bootstrap seed (default 0)")
    g.add_argument("--resamples", type=positive_int, default=stats.BOOTSTRAP,
                   help=f"bootstrap resamples (default {stats.BOOTSTRAP})")
    g.add_argument("--truncate-state", action="store_true",
                   help="cut over-long states to fit the window instead of failing those records "
                        "(refused with Decision Index rows, which are never cut)")
    g.add_argument("--write-demo-data", type=positive_int, metavar="N",
                   help="first write N labelled demo records to --data (a new file), labels drawn "
                        "(seeded by --seed) from the first model's own probabilities at "
                        f"temperature {demo.TEMPERATURE:g}: something to try eval and calibrate on")


def quant_list(text: str) -> list[str]:
    """``--quants``: comma-separated GGUF quant types."""
    quants = [q.strip() for q in text.split(",") if q.strip()]
    if not quants or any(not re.fullmatch(r"[A-Za-z0-9_]+", q) for q in quants):
        raise argparse.ArgumentTypeError(f"expected quant types separated by commas, such as Q8_0,Q4_K_M; "
                                          f"got {text!r}")
    return quants


def _gguf_of(directory: Path, quant: str) -> str:
    """The one .gguf of ``directory`` whose name carries ``quant`` as a whole word (Q4_K is not Q4_K_M)."""
    word = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    files = sorted(directory.glob("*.gguf"))
    found = [f for f in files if word.search(f.stem)]
    if len(found) != 1:
        what = "no" if not found else "more than one"
        raise errors.InvalidValue(f"{directory} holds {what} .gguf named for {quant} (it holds "
                                  f"{', '.join(f.name for f in files) or 'none'})", field="quants")
    return str(found[0])


def model_names(models: Sequence[str] | None, quants: Sequence[str] | None) -> list[str]:
    """The models to run: ``--model`` as given, or with ``--quants`` one per quant of the one ``--model``."""
    if not quants:
        if not models:
            raise errors.InvalidValue("give --model (or --quants with a catalog family)", field="model")
        return list(models)
    if models and len(models) > 1:
        raise errors.InvalidValue("--quants takes one --model: a catalog family or a directory of .gguf "
                                  f"files, not {len(models)}", field="quants")
    base = models[0] if models else DEFAULT_FAMILY
    if Path(base).is_dir():
        return [_gguf_of(Path(base), q) for q in quants]
    family, _, source = base.partition("@")
    family = family.split(":", 1)[0]
    return [f"{family}:{q}" + (f"@{source}" if source else "") for q in quants]


def models_with_calibrations(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    models, cals = model_names(args.model, args.quants), list(args.calibration or [])
    if len(cals) == 1:
        cals = cals * len(models)
    if cals and len(cals) != len(models):
        raise errors.InvalidValue(f"give --calibration once, or once per --model ({len(models)}), "
                                  f"not {len(cals)} times", field="calibration")
    return [(m, c if c not in (None, "none") else None)
            for m, c in zip(models, cals or [None] * len(models))]


def _labels(pairs: Sequence[tuple[str, str | None]]) -> list[str]:
    labels = []
    for model, cal in pairs:
        path = Path(model)
        name = f"{path.parent.name}/{path.name}" if path.suffix == ".gguf" else path.name or model
        labels.append(name + (f"+{Path(cal).stem}" if cal else ""))
    return labels


def _directories(out: Path, labels: Sequence[str]) -> list[Path]:
    if len(labels) == 1:
        return [out]
    used: set[str] = set()
    dirs = []
    for label in labels:
        slug = re.sub(r"[^A-Za-z0-9._+-]+", "-", label).strip("-.") or "model"
        unique, n = slug, 2
        while unique in used:
            unique, n = f"{slug}-{n}", n + 1
        used.add(unique)
        dirs.append(out / unique)
    return dirs


def loader(args: argparse.Namespace, model: str, calibration: str | None) -> Callable[[], Models[Clef]]:
    return lambda: load_model(argparse.Namespace(**(vars(args) | {"model": model,
                                                                   "calibration": calibration})))


def write_model_files(run: predict.ModelRun, records: int) -> dict[str, Any]:
    """predictions.jsonl, metrics.json and errors.jsonl of one model; returns its metrics."""
    rows = predict.prediction_rows(run.lines)
    with open(run.directory / "predictions.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    with open(run.directory / "errors.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in predict.problems(run.lines))
    result = metrics.full(rows) | {"records": predict.counts(run.lines, records)}
    predict.write_json(run.directory / "metrics.json", result)
    return result


def summarize_runs(runs: Sequence[predict.ModelRun], model_metrics: Sequence[dict[str, Any]], *,
                   seed: int, resamples: int) -> list[dict[str, Any]]:
    reference = runs[0]
    ref_rows = predict.prediction_rows(reference.lines, keep_line=True)
    summaries = []
    for i, (run, m) in enumerate(zip(runs, model_metrics)):
        overall = m.get("overall") or {}
        n = overall.get("n", 0)
        correct = round(overall.get("accuracy", 0.0) * n) if n else 0
        s: dict[str, Any] = {"label": run.label, "directory": str(run.directory), "info": run.info,
                             "cost": run.cost.to_dict(), "metrics": m, "is_reference": i == 0,
                             "accuracy_ci95": list(stats.wilson(correct, n)),
                             "notes": stats.auto_decide_note(overall), "resamples": resamples}
        if i:
            s["agreement"] = agreement.compare(reference.lines, run.lines)
            rows = predict.prediction_rows(run.lines, keep_line=True)
            s["deltas"] = stats.paired_deltas(ref_rows, rows, seed=seed, resamples=resamples)
        summaries.append(s)
    return summaries


def add_benchmarks(summaries: Sequence[dict[str, Any]], runs: Sequence[predict.ModelRun], rows: suite.Suite,
                   *, seed: int, resamples: int) -> None:
    """Each model's per-benchmark numbers (``decision_index``) and, past the reference, its per-benchmark
    agreement and deltas (``benchmark_deltas``)."""
    for i, (s, run) in enumerate(zip(summaries, runs)):
        s["benchmarks"] = decision_index.table(run.lines, rows.benchmarks, rows.not_computed, seed=seed,
                                           resamples=resamples)
        if i:
            s["benchmark_deltas"] = decision_index.deltas(runs[0].lines, run.lines, rows.benchmarks, seed=seed,
                                                      resamples=resamples)


def run_eval(args: argparse.Namespace) -> int:
    pairs = models_with_calibrations(args)
    if args.plots:
        plots.require()  # before anything loads: a missing extra is said at once
    if bool(args.data) == bool(args.rows):
        raise errors.InvalidValue("give the data once: ROWS or --data FILE", field="data")
    data = Path(args.data or args.rows)
    if args.write_demo_data:
        if data.exists():
            raise errors.InvalidValue(f"{data} exists: demo data is written to a new file",
                                      field="data")
        with loader(args, *pairs[0])() as clef:
            demo.write(clef.default_model, data, args.write_demo_data, seed=args.seed)
    rows = suite.read(data) if suite.is_suite(data) else None
    if rows and args.truncate_state:
        raise errors.InvalidValue("--truncate-state is refused with Decision Index rows: a row over the window is "
                                  "never cut, it counts as unanswered", field="truncate_state")
    records = rows.records if rows else list(labelled.read(data))
    if not records:
        raise errors.InvalidInput(f"{data} holds no records", field="data")
    data_sha = sha256_file(data)
    out = Path(args.output)
    labels = _labels(pairs)
    runs, model_metrics = [], []
    for (model, cal), label, directory in zip(pairs, labels, _directories(out, labels)):
        identity = {"format": EVAL_FORMAT, "data_sha256": data_sha, "records": len(records),
                    "model": str(Path(model).resolve()) if Path(model).exists() else model,
                    "calibration": str(Path(cal).resolve()) if cal else "none",
                    "truncate_state": args.truncate_state, "max_length": args.max_length}
        run = predict.run_model(loader(args, model, cal), records, directory, label=label,
                                identity=identity, truncate_state=args.truncate_state,
                                media_policy=media_policy(data))
        runs.append(run)
        model_metrics.append(write_model_files(run, len(records)))
    summaries = summarize_runs(runs, model_metrics, seed=args.seed, resamples=args.resamples)
    if rows:
        add_benchmarks(summaries, runs, rows, seed=args.seed, resamples=args.resamples)
    counts = model_metrics[0]["records"]
    text = report.markdown(summaries, data=str(data), counts=counts, seed=args.seed)
    (out / "report.md").write_text(text + report.benchmarks_markdown(summaries), encoding="utf-8")
    written = []
    if args.plots:
        written = [p for p in (plots.reliability(summaries, out / "reliability.png"),
                               plots.tradeoff(summaries, out / "tradeoff.png"),
                               rows and plots.benchmarks(summaries, out / "benchmarks.png")) if p]
    summary = {"format": EVAL_FORMAT, "data": str(data), "data_sha256": data_sha, "records": counts,
               "seed": args.seed, "models": summaries, "plots": [str(p) for p in written]}
    if rows:
        summary["suite"] = {"format": "decision-index", "benchmarks": sorted(set(rows.benchmarks.values()))}
    predict.write_json(out / "summary.json", summary)
    if args.json:
        print(json.dumps(summary, indent=2, ensure_ascii=False))
    else:
        print(report.console(summaries))
        print(f"report: {out / 'report.md'}", file=sys.stderr)
    return 0
