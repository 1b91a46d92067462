"""What a user reads: ``report.md`` (Markdown tables to paste) and the short console table.

``summary`` is one dict per model (``cli._summaries`` builds them): its label, quant, cost, the
label-free agreement with the reference, and with labels its metrics, Wilson interval and deltas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from clef_gguf.core.limits import GiB, MiB


def _f(x: Any, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _delta(d: dict[str, Any] | None, digits: int = 4) -> str:
    if not d:
        return "-"
    lo, hi = d["ci95"]
    mark = " *" if d["significant"] else ""
    return f"{d['delta']:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]{mark}"


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def cost_cells(s: dict[str, Any]) -> list[str]:
    c = s["cost"]
    return [f"{c['tower_bytes'] / MiB:,.1f}", f"{c['peak_rss_bytes'] / MiB:,.0f}",
            _f(c["records_per_s"], 1), _f(c["tokens_per_s"], 0)]


def agreement_cells(s: dict[str, Any]) -> list[str]:
    a = (s.get("agreement") or {}).get("overall")
    if not a or not a.get("n"):
        return ["(reference)" if s.get("is_reference") else "-", "-", "-", "-"]
    return [_f(a["top1"]), _f(a["mean_abs_dp"], 5), _f(a["max_abs_dp"], 4), _f(a["mean_kl"], 6)]


def per_gib(s: dict[str, Any]) -> float | None:
    """Top-1 agreement per GiB of tower: weighs a quant with layers kept wider (a few % more bytes)
    against the plain quants around it; None for the reference."""
    a = (s.get("agreement") or {}).get("overall")
    if not a or not a.get("n") or not s["cost"]["tower_bytes"]:
        return None
    return a["top1"] / (s["cost"]["tower_bytes"] / GiB)


def label_cells(s: dict[str, Any]) -> list[str]:
    m = s["metrics"].get("overall") or {}
    if not m:
        return ["-"] * 6
    lo, hi = s["accuracy_ci95"]
    d = s.get("deltas") or {}
    return [f"{_f(m['accuracy'], 3)} [{_f(lo, 3)}, {_f(hi, 3)}]", _delta(d.get("accuracy"), 3),
            _f(m["nll"]), _delta(d.get("nll")), _f(m["ece"]), _f(m["brier"])]


def markdown(summaries: Sequence[dict[str, Any]], *, data: str, counts: dict[str, Any],
             seed: int) -> str:
    labelled = any(s["metrics"].get("overall") for s in summaries)
    lines = [f"# clef-gguf eval: `{data}`", "",
             f"{counts['records']} records, {counts['answered']} answered, "
             f"{sum(counts['failed'].values())} failed, {counts['questions']} questions, "
             f"{counts['labelled_questions']} labelled ({counts['label_errors']} unusable labels; "
             "see errors.jsonl). Counts are the reference's.", ""]
    header = ["model", "quant", "tower MiB", "peak RSS MiB", "records/s", "tokens/s"]
    rows = [[s["label"], _f(s["info"].get("quant"))] + cost_cells(s) for s in summaries]
    if len(summaries) > 1:
        header += ["top-1 agreement", "mean |Δp|", "max |Δp|", "mean KL", "tower bytes", "top-1 per GiB"]
        rows = [r + agreement_cells(s) + [f"{s['cost']['tower_bytes']:,}", _f(per_gib(s), 2)]
                for r, s in zip(rows, summaries)]
    if labelled:
        header += ["accuracy [95% Wilson]", "Δ accuracy [95% bootstrap]", "NLL", "Δ NLL [95%]",
                   "ECE", "Brier"]
        rows = [r + label_cells(s) for r, s in zip(rows, summaries)]
    lines += _table(header, rows)
    lines += ["", "Agreement is with the first model (the reference), on every question both "
              "answered, labels or not: top-1 = the same top option; |Δp| over every option "
              "probability; KL(reference ‖ model) in nats. Δ = model - reference on the same "
              f"labelled questions, 95% paired bootstrap ({summaries[0].get('resamples', 1000)} "
              f"resamples, seed {seed}); * = the interval excludes 0. Lower is better for NLL, "
              "ECE (top-label, 10 bins) and Brier (multiclass). Size is the tower file; peak RSS "
              "and rates were measured in this run on this machine (rates after the load)."]
    if len(summaries) > 1:
        lines += _per_type(summaries)
    for s in summaries:
        notes = s.get("notes") or []
        if notes:
            lines += ["", f"Notes on {s['label']}:", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n"


def _per_type(summaries: Sequence[dict[str, Any]]) -> list[str]:
    rows = []
    for s in summaries[1:]:
        agreement = s.get("agreement") or {}
        for qtype, a in sorted((agreement.get("per_type") or {}).items()):
            rows.append([s["label"], qtype, str(a["n"]), _f(a["top1"]), _f(a["mean_abs_dp"], 5),
                         _f(a["mean_kl"], 6)])
        worst = agreement.get("worst_questions") or []
        if worst:
            per_q = agreement["per_question"]
            rows += [[s["label"], f"question {q}", str(per_q[q]["n"]), _f(per_q[q]["top1"]),
                      _f(per_q[q]["mean_abs_dp"], 5), _f(per_q[q]["mean_kl"], 6)] for q in worst]
    if not rows:
        return []
    return ["", "## Agreement per question type, and the questions where each model departs most",
            ""] + _table(["model", "type / question", "n", "top-1 agreement", "mean |Δp|",
                          "mean KL"], rows)


def console(summaries: Sequence[dict[str, Any]]) -> str:
    """A few columns that fit a terminal."""
    lines = [f"{'model':<28} {'MiB':>8} {'rec/s':>8} {'top-1':>7} {'mean KL':>9} {'accuracy':>9} {'NLL':>8}"
             f" {'bytes':>13} {'top-1/GiB':>10}"]
    for s in summaries:
        a = ((s.get("agreement") or {}).get("overall")) or {}
        m = s["metrics"].get("overall") or {}
        lines.append(f"{s['label'][:28]:<28} {s['cost']['tower_bytes'] / MiB:>8.1f} "
                     f"{_f(s['cost']['records_per_s'], 1):>8} {_f(a.get('top1'), 4):>7} "
                     f"{_f(a.get('mean_kl'), 6):>9} {_f(m.get('accuracy'), 4):>9} {_f(m.get('nll'), 4):>8}"
                     f" {s['cost']['tower_bytes']:>13,} {_f(per_gib(s), 2):>10}")
    return "\n".join(lines)


def _share_cell(block: dict[str, Any] | None) -> str:
    if not block or block.get("value") is None:
        return "-"
    ci = block.get("ci95")
    return f"{block['value']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def benchmarks_markdown(summaries: Sequence[dict[str, Any]]) -> str:
    """The per-benchmark, per-model table of a Decision Index suite, its unanswered rows and the metrics
    not computed ("" when the data was no suite)."""
    if not any(s.get("benchmarks") for s in summaries):
        return ""
    compared = len(summaries) > 1
    header = ["benchmark", "model", "quant", "rows", "coverage", "accuracy", "macro-F1", "case-exact"]
    if compared:
        header += ["top-1 agreement", "Δ accuracy [95%]", "Δ macro-F1 [95%]", "Δ case-exact [95%]"]
    rows, unanswered, missing = [], [], {}
    names = sorted({b for s in summaries for b in s.get("benchmarks", {})})
    for name in names:
        for s in summaries:
            b = s.get("benchmarks", {}).get(name)
            if b is None:
                continue
            row = [name, s["label"], _f(s["info"].get("quant")), str(b["rows"]), _share_cell(b["coverage"]),
                   _share_cell(b["accuracy"]), _share_cell(b["macro_f1"]), _share_cell(b["case_exact"])]
            if compared:
                d = (s.get("benchmark_deltas") or {}).get(name) or {}
                a = d.get("agreement") or {}
                row += ["(reference)" if s.get("is_reference") else _f(a.get("top1")),
                        *(_delta(d.get(m), 3) for m in ("accuracy", "macro_f1", "case_exact"))]
            rows.append(row)
            unanswered += [f"- {name}, {s['label']}: row {u['row']} (id {u['id']}): {u['code']}"
                           for u in b["unanswered"]]
            if b.get("not_computed"):
                missing[name] = b["not_computed"]
    lines = ["", "## Per benchmark (Decision Index rows)", "", *_table(header, rows), "",
             "coverage = rows answered / rows; accuracy over the expected keys of the answered rows; "
             "macro-F1 over option keys (the keys expected or chosen); case-exact = answered rows with "
             "every question right. [95%]: Wilson intervals, a bootstrap over rows for macro-F1; Δ = model - "
             "reference on the rows both answered, paired bootstrap over rows, * = the interval excludes 0."]
    if unanswered:
        lines += ["", "Unanswered rows (refused, never truncated: counted against coverage):", *unanswered]
    lines += ["", "Not computed (they need the kit's scorer or forecasts, not answers alone): nDCG@10, Brier "
              "against forecasts and any other metric a row's `scoring` names"
              + ("; named by these rows: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in missing.items())
                 if missing else "") + "."]
    return "\n".join(lines) + "\n"
