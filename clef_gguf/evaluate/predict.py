"""One model over the labelled records: every question's logits and probabilities, resumable.

Each record's outcome is appended (and fsynced) to ``records.jsonl`` in the model's directory as
soon as it is computed, so an interrupted eval continues where it stopped and a finished model is
not loaded again. ``run.json`` binds the directory to the model files, the data file and the
calibration it was computed with: another model or data in the same directory is refused rather
than mixed. The requests go through the engine (``clef_gguf.runtime.engine``): refused requests keep
their error in place, requests about one state run together so it is decoded once. A record's images
and videos are read under the run's ``MediaPolicy`` (the commands': any path or URL, a relative path
from the data file's directory, as ``batch`` reads them); one that cannot be read fails its record.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clef_gguf.pipeline import answer
from clef_gguf.runtime import engine
from clef_gguf.core import errors
from clef_gguf.bulk.output import Journal, read_journal
from clef_gguf.evaluate import records as labelled
from clef_gguf.evaluate.cost import Cost, PeakRss, file_bytes
from clef_gguf.media.sources import MediaPolicy
from clef_gguf.pipeline.answer import Decision
from clef_gguf.pipeline.encode import Prepared
from clef_gguf.runtime.model import Clef
from clef_gguf.runtime.registry import Models

JOURNAL = "records.jsonl"
RUN = "run.json"


class LogitsModel:
    """A loaded Clef as an engine model whose answer is each question's fp32 logits and
    probabilities (the calibration's temperatures applied, exactly as the runtime applies them)
    instead of the rounded response."""

    def __init__(self, clef: Models[Clef]) -> None:
        self.clef = clef

    def prepare(self, request: Any, *, truncate_state: bool = False,
                media_policy: MediaPolicy | None = None) -> Prepared:
        return self.clef.prepare(request, truncate_state=truncate_state, media_policy=media_policy)

    def run(self, prepared: Prepared) -> Decision:
        enc = prepared.encoded
        model = self.clef.answering(prepared)  # the base or the fine-tune the record names
        logits = model.logits(enc)
        probs = answer.split_probabilities(logits, enc.option_counts, model.temperatures(enc))
        return Decision({"logits": logits, "probs": probs}, {"tokens": float(enc.n_tokens)})


@dataclass
class ModelRun:
    """What eval keeps of one model: its directory, the journal's lines in input order, cost."""

    label: str
    directory: Path
    lines: list[dict[str, Any]]
    cost: Cost
    info: dict[str, Any]


def _identity_mismatch(stored: dict[str, Any], identity: dict[str, Any]) -> list[str]:
    return [k for k, v in identity.items() if k in stored and stored[k] != v]


def _check_identity(directory: Path, identity: dict[str, Any]) -> dict[str, Any]:
    path = directory / RUN
    if not path.exists():
        return {}
    try:
        stored = json.loads(path.read_text())
    except ValueError:
        raise errors.CorruptOutput(f"{path} is not what clef-gguf eval wrote: give a new --output",
                                   field="output") from None
    wrong = _identity_mismatch(stored, identity)
    if wrong:
        raise errors.InvalidValue(
            f"{directory} holds results of another run ({', '.join(wrong)} differ): give a new "
            "--output, or remove that directory to compute it again", field="output")
    return stored


def write_json(path: Path, obj: Any) -> None:
    """Whole-file write through a temporary file: a crash leaves the old file or the new."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run_model(load: Callable[[], Clef | Models[Clef]], records: list[labelled.LabelledRecord], directory: Path,
              *, label: str, identity: dict[str, Any], truncate_state: bool = False,
              window: int = engine.WINDOW, progress: bool = True, with_binding: bool = False,
              media_policy: MediaPolicy | None = None) -> ModelRun:
    """Compute what ``directory`` does not hold yet, and return every record's line.
    ``with_binding``: also hash what a calibration of this model binds to (``info["binding"]``).
    ``media_policy``: where the records' pictures may come from (None: the model's default)."""
    directory.mkdir(parents=True, exist_ok=True)
    stored = _check_identity(directory, identity)
    journal_path = directory / JOURNAL
    # Earlier versions skipped records with pictures ({"skipped": "media"}): those are computed now,
    # and their new line, written later, is the one read back (``_lines``).
    done = {int(line["id"]) for line in read_journal(journal_path) if "skipped" not in line}
    todo = [r for r in records if r.index not in done]
    if not todo and "cost" in stored:  # finished earlier: no need to load the model again
        return ModelRun(label, directory, _lines(journal_path, records),
                        Cost.from_dict(stored["cost"]), stored.get("info", {}))
    if progress:
        print(f"eval {label}: {len(todo)} records to compute, {len(records) - len(todo)} already done",
              file=sys.stderr, flush=True)
    with PeakRss() as rss:
        t0 = time.perf_counter()
        with load() as loaded:
            clef = Models.of(loaded)  # a loader may give one Clef or the models of --adapter flags
            load_s = time.perf_counter() - t0
            info = {"name": clef.info.get("name"), "quant": clef.info.get("quant"),
                    "backend": clef.info.get("backend"), "model_hash": clef.provenance.model_hash,
                    "calibration_version": clef.provenance.calibration_version}
            if with_binding:
                # the model that answers by default: a fine-tune's binds its adapter and head too
                info["binding"] = clef.default_model.calibration_binding()
            wrong = _identity_mismatch(stored.get("info", {}), {"model_hash": info["model_hash"]})
            if wrong:
                raise errors.InvalidValue(f"{directory} holds results of another model: give a "
                                          "new --output", field="output")
            write_json(directory / RUN, identity | {"info": info})
            t1 = time.perf_counter()
            tokens = _compute(LogitsModel(clef), todo, Journal(journal_path), label=label,
                              truncate_state=truncate_state, window=window, progress=progress,
                              media_policy=media_policy)
            run_s = time.perf_counter() - t1
            paths = list(clef.base.files.paths().values())
            tower = clef.base.files.tower
            tower_bytes = file_bytes([tower.parent if tower.name == "config.json" else tower])
    cost = Cost(tower_bytes, file_bytes(paths), rss.peak, load_s, run_s, len(todo), tokens)
    write_json(directory / RUN, identity | {"info": info, "cost": cost.to_dict()})
    return ModelRun(label, directory, _lines(journal_path, records), cost, info)


def _lines(journal_path: Path, records: list[labelled.LabelledRecord]) -> list[dict[str, Any]]:
    """The journal's lines of ``records``, in input order (a record's last line where it has two)."""
    by_index = {int(line["id"]): line for line in read_journal(journal_path)}
    return [by_index[r.index] for r in records if r.index in by_index]


def _compute(model: LogitsModel, todo: list[labelled.LabelledRecord], journal: Journal, *,
             label: str, truncate_state: bool, window: int, progress: bool,
             media_policy: MediaPolicy | None) -> int:
    from tqdm import tqdm

    bar = tqdm(total=len(todo), unit="rec", desc=f"eval {label}", file=sys.stderr,
               disable=not (progress and sys.stderr.isatty()), dynamic_ncols=True)
    tokens = 0
    try:
        for chunk in engine.windows(todo, window):
            for line in _window(model, chunk, truncate_state, media_policy):
                journal.write(line)
                tokens += int(line.get("tokens", 0))
                bar.update(1)
    finally:
        journal.close()
        bar.close()
    return tokens


def _window(model: LogitsModel, chunk: list[labelled.LabelledRecord], truncate_state: bool,
            media_policy: MediaPolicy | None) -> Iterable[dict[str, Any]]:
    asked = {i: engine.prepare(model, r.request, truncate_state=truncate_state, media_policy=media_policy)
             for i, r in enumerate(chunk) if r.error is None}
    ready = {i: p for i, p in asked.items() if not isinstance(p, Exception)}
    outcomes: dict[int, engine.Outcome | None] = dict(zip(ready, engine.run(model, list(ready.values()))))
    for i, record in enumerate(chunk):
        head = {"id": str(record.index), "record_id": record.record_id}
        outcome = asked.get(i) if i not in ready else outcomes.get(i)
        if record.error is not None:
            yield head | record.error
        elif isinstance(outcome, tuple):
            yield head | _scored(ready[i], outcome, record.labels)
        else:  # refused by prepare, failed in the run, or (never without a stop) left unrun
            failure = outcome if isinstance(outcome, Exception) else errors.NotComputed("not computed")
            yield head | {"error": engine.error_body(failure, f"record {record.index}")}


def _scored(prepared: Prepared, outcome: tuple[dict[str, Any], dict[str, float]],
            labels: dict[str, Any]) -> dict[str, Any]:
    request = prepared.request
    targets, problems = labelled.targets(request, labels)
    probs: list[np.ndarray] = outcome[0]["probs"]
    logits = np.asarray(outcome[0]["logits"], dtype=np.float32)
    bounds = np.cumsum((0,) + tuple(prepared.encoded.option_counts))
    questions = {q.id: {"type": q.type, "option_ids": labelled.option_ids(q),
                        "logits": logits[a:b].tolist(), "probs": p.tolist()}
                 for q, p, a, b in zip(request.questions, probs, bounds[:-1], bounds[1:])}
    line: dict[str, Any] = {"tokens": prepared.encoded.n_tokens, "questions": questions,
                            "targets": targets}
    if problems:
        line["label_errors"] = problems
    return line


def prediction_rows(lines: list[dict[str, Any]], *, keep_line: bool = False) -> list[dict[str, Any]]:
    """clef-finetune's prediction rows: one per labelled question, in the request's question
    order: ``{"record_id", "question_id", "type", "option_ids", "probs", "target"}``.
    ``keep_line`` adds the record's line number (``"line"``): record ids may be absent, and
    pairing two models' rows needs a key."""
    rows = []
    for line in lines:
        targets = line.get("targets", {})
        for qid, q in line.get("questions", {}).items():
            if qid in targets:
                row = {"record_id": line["record_id"], "question_id": qid, "type": q["type"],
                       "option_ids": q["option_ids"], "probs": q["probs"], "target": targets[qid]}
                rows.append(row | {"line": int(line["id"])} if keep_line else row)
    return rows


def problems(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every record error and unusable label, with the line number and id it belongs to."""
    out = []
    for line in lines:
        where = {"line": int(line["id"]), "record_id": line["record_id"]}
        if "error" in line:
            out.append(where | {"error": line["error"]})
        for problem in line.get("label_errors", []):
            out.append(where | problem)
    return out


def counts(lines: list[dict[str, Any]], records: int) -> dict[str, Any]:
    failed: dict[str, int] = {}
    for line in lines:
        if "error" in line:
            code = str(line["error"].get("code"))
            failed[code] = failed.get(code, 0) + 1
    return {"records": records, "answered": sum("questions" in line for line in lines), "failed": failed,
            "label_errors": sum(len(line.get("label_errors", [])) for line in lines),
            "questions": sum(len(line.get("questions", {})) for line in lines),
            "labelled_questions": sum(len(line.get("targets", {})) for line in lines)}
