"""PNG plots (matplotlib, the ``eval`` extra): a reliability diagram per model, and agreement (or
accuracy) against size and speed, so the trade-off between quants is seen at a glance. The
numbers and report.md never need matplotlib; ``require()`` is called before any model loads."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clef_gguf.core.deps import need
from clef_gguf.core.limits import MiB


def require() -> Any:
    """``matplotlib.pyplot`` with a non-interactive backend, or MissingDependency naming the
    extra that installs it."""
    matplotlib = need("matplotlib", "eval")
    matplotlib.use("Agg")
    return need("matplotlib.pyplot", "eval")


def reliability(summaries: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Accuracy against confidence per 10 equal-width bins, one panel per model (models without
    labels are left out; None when no model has any)."""
    labelled = [s for s in summaries if s["metrics"].get("reliability")
                and any(b["n"] for b in s["metrics"]["reliability"])]
    if not labelled:
        return None
    plt = require()
    fig, axes = plt.subplots(1, len(labelled), figsize=(3.2 * len(labelled), 3.4), squeeze=False)
    for ax, s in zip(axes[0], labelled):
        bins = s["metrics"]["reliability"]
        centres = [(b["lo"] + b["hi"]) / 2 for b in bins if b["n"]]
        accuracy = [b["accuracy"] for b in bins if b["n"]]
        ax.bar(centres, accuracy, width=0.09, color="tab:blue", alpha=0.8, label="accuracy")
        ax.plot([0, 1], [0, 1], "k--", linewidth=0.8, label="perfect")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"{s['label']}\nECE {s['metrics']['overall']['ece']:.3f}", fontsize=9)
        ax.set_xlabel("confidence (top option)")
    axes[0][0].set_ylabel("accuracy")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tradeoff(summaries: Sequence[dict[str, Any]], path: Path) -> Path:
    """Top-1 agreement with the reference (accuracy when only one model ran) against tower size
    and records/s."""
    plt = require()
    compared = len(summaries) > 1
    values = [((s.get("agreement") or {}).get("overall") or {}).get("top1", 1.0) if compared
              else (s["metrics"].get("overall") or {}).get("accuracy", float("nan")) for s in summaries]
    what = "top-1 agreement with the reference" if compared else "accuracy"
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, (xlabel, xs) in zip(axes, (
            ("tower size (MiB)", [s["cost"]["tower_bytes"] / MiB for s in summaries]),
            ("records/s on this machine", [s["cost"]["records_per_s"] for s in summaries]))):
        ax.scatter(xs, values, color="tab:orange")
        for x, y, s in zip(xs, values, summaries):
            ax.annotate(s["label"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def benchmarks(summaries: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Accuracy per Decision Index benchmark, one bar per model, with its 95% interval (None when the data
    was no suite)."""
    names = sorted({b for s in summaries for b in s.get("benchmarks", {})})
    if not names:
        return None
    plt = require()
    width = 0.8 / len(summaries)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(names) * len(summaries) ** 0.5), 3.6))
    for i, s in enumerate(summaries):
        blocks = [s.get("benchmarks", {}).get(n, {}).get("accuracy") or {} for n in names]
        values = [b.get("value") if b.get("value") is not None else float("nan") for b in blocks]
        lows = [v - b["ci95"][0] if b.get("ci95") else 0.0 for v, b in zip(values, blocks)]
        highs = [b["ci95"][1] - v if b.get("ci95") else 0.0 for v, b in zip(values, blocks)]
        ax.bar([j + i * width for j in range(len(names))], values, width, yerr=[lows, highs], capsize=2,
               label=s["label"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy (95% Wilson)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
