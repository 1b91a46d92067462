"""A response as lines for people (``clef-gguf decide --format text``): each answer, and under it the
state spans its evidence names, with their shares (and Δp when occlusion ran)."""

from __future__ import annotations

from typing import Any

from clef_gguf.core.questions import question_type

SHOWN_CHARS = 60  # a longer span is shown cut, with its character range to find it whole


def as_text(response: dict[str, Any]) -> str:
    lines = []
    evidence = response.get("evidence", {})
    for qid, item in response["answers"].items():
        lines.append(f"{qid}: {_answer(qid, item)}")
        block = evidence.get("questions", {}).get(qid)
        if block is not None:
            lines += _evidence(block)
    if "reruns" in evidence:
        lines.append(f"occlusion: {evidence['reruns']} re-runs")
    if response.get("truncated"):
        lines.append("the state was truncated to fit the window")
    lines += [f"warning: {w['message']}" for w in response.get("warnings", [])]
    return "\n".join(lines)


def _answer(qid: str, item: dict[str, Any]) -> str:
    """The answer's line: its type's ``text`` (core.questions) over its keys."""
    return question_type(item.get("type"), field=f"answers.{qid}.type").text.format_map(item)


def _evidence(block: dict[str, Any]) -> list[str]:
    shares = ", ".join(f"{k} {v:.0%}" for k, v in block["shares"].items())
    lines = [f"  attention of '{block['option']}': {shares}"]
    for rank, span in enumerate(block["spans"], 1):
        text = span["text"] if len(span["text"]) <= SHOWN_CHARS else span["text"][:SHOWN_CHARS - 3] + "..."
        where = f" {span['path']}" if "path" in span else ""
        delta = ""
        if "delta_p" in span:
            delta = f"  Δp {span['delta_p']:+.4f}"
            if "top_option" in span:
                delta += f" -> {span['top_option']}"
        lines.append(f"  {rank}. {text!r} [{span['start']}:{span['end']}]{where}  "
                     f"{span['share']:.1%} of the state's{delta}")
    for i, picture in enumerate(block.get("pictures", []), 1):
        lines.append(f"  picture {i}: {picture['share']:.1%}")
    return lines
