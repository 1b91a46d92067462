"""The question-type registry (``core.questions``): every registered type is handled by each piece that
derives from it (wire, parsing, answer, text, schema, eval labels, fit bands, refusals, MCP); a type
nobody registered is an ``InvalidQuestionType`` everywhere; "which option won" is one rule; and no module
outside the registry dispatches on a type's name."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pydantic
import pytest

from clef_gguf.agent import mcp_server
from clef_gguf.core import errors, refusals
from clef_gguf.core.questions import (CHOICE_OPTIONS, MAX_QUESTIONS, QUESTION_TYPES, SCORE_LEVELS, TYPE_INDEX,
                                      TYPES, Criteria, QuestionType, question_type, winner)
from clef_gguf.evaluate import decision_index, fit, metrics
from clef_gguf.evaluate import records as labelled
from clef_gguf.formats import calibration as cal
from clef_gguf.pipeline import answer, answer_text, evidence_spans, wire
from clef_gguf.pipeline.request import Option, Question, parse_request
from clef_gguf.server import schema

ROOT = Path(__file__).resolve().parents[2]
IDS = [t.name for t in TYPES]

# A question of each criteria rule as a client sends it (the rules, not the type names: a new type
# with an existing rule is covered without an edit here).
CRITERIA = {Criteria.FIXED: None, Criteria.NAMED: {"b": "B", "a": None, "c": {"x": 1}},
            Criteria.LEVELS: ["low", "mid", "high"]}


def sent(entry: QuestionType) -> dict:
    body = {"type": entry.name, "instructions": "Which?"}
    if CRITERIA[entry.criteria] is not None:
        body["criteria"] = CRITERIA[entry.criteria]
    return body


def parsed(entry: QuestionType) -> Question:
    return parse_request({"state": "s", "questions": {"q": sent(entry)}}).questions[0]


def probs(question: Question) -> np.ndarray:
    p = np.arange(1, len(question.options) + 1, dtype=np.float32)
    return (p / p.sum()).astype(np.float32)


def bogus(qid: str = "q") -> Question:
    return Question(qid, "bogus", "x", (Option("true", None), Option("false", None)), ("true", "false"))


def test_the_registry_is_the_heads_order_and_the_strict_counts():
    assert QUESTION_TYPES == tuple(IDS) == ("noul", "choice", "score")  # type_embedding rows: never reorder
    assert [t.row for t in TYPES] == list(range(len(TYPES))) == [TYPE_INDEX[n] for n in IDS]
    assert len(set(IDS)) == len(IDS) and MAX_QUESTIONS == 64
    assert (CHOICE_OPTIONS, SCORE_LEVELS) == ((2, 255), (2, 10))
    for entry in TYPES:
        assert question_type(entry.name) is entry
        assert bool(entry.fixed) == (entry.criteria is Criteria.FIXED)
        assert (entry.counts is None) == (entry.too_few is None) == (entry.too_many is None)
        assert entry.answer and len({a.key for a in entry.answer}) == len(entry.answer)


@pytest.mark.parametrize("entry", TYPES, ids=IDS)
def test_the_wire_takes_every_type_and_documents_it(entry):
    model = {m.model_config.get("title"): m for m in wire.QUESTION_MODELS}[entry.name]
    assert model.__name__ == f"{entry.name.capitalize()}Question" and model.__doc__ == entry.criteria_doc
    model.model_validate(sent(entry))
    wire.SystemOneRequest.model_validate({"state": "s", "questions": {"q": sent(entry)}})
    shown = pydantic.TypeAdapter(wire.Questions).json_schema()
    assert entry.name in str(shown)


@pytest.mark.parametrize("entry", TYPES, ids=IDS)
def test_parsing_follows_the_criteria_rule(entry):
    question = parsed(entry)
    assert question.type == entry.name and question.question_type is entry and question.type_index == entry.row
    ids = [o.id for o in question.options]
    if entry.criteria is Criteria.FIXED:
        assert tuple(ids) == question.report_order == tuple(oid for oid, _ in entry.fixed)
        assert [o.description for o in question.options] == [d for _, d in entry.fixed]
    elif entry.criteria is Criteria.NAMED:
        assert ids == sorted(CRITERIA[Criteria.NAMED]) and question.report_order == tuple(CRITERIA[Criteria.NAMED])
    else:
        assert ids == [str(i) for i in range(len(CRITERIA[Criteria.LEVELS]))] == list(question.report_order)
        assert question.legend == tuple(CRITERIA[Criteria.LEVELS])


@pytest.mark.parametrize("entry", TYPES, ids=IDS)
def test_the_answer_text_and_schema_follow_the_entry(entry):
    question = parsed(entry)
    got = answer.answer(question, probs(question))
    assert list(got) == ["type", *(a.key for a in entry.answer)] and got["type"] == entry.name
    model = {m.__name__: m for m in schema.ANSWER_MODELS}[f"{entry.name.capitalize()}Answer"]
    model.model_validate(got)
    pydantic.TypeAdapter(schema.Answers).validate_python({"q": got})
    text = answer_text.as_text({"answers": {"q": got}})
    assert text == f"q: {entry.text.format_map(got)}"
    line = mcp_server.summary({"answers": {"q": got}, "model": "m"}).splitlines()[0]
    assert line.startswith(f"q: {entry.name}") and f"`{entry.name}` = {entry.summary}" in mcp_server.DECIDE


@pytest.mark.parametrize("entry", TYPES, ids=IDS)
def test_eval_labels_read_and_write_every_option(entry):
    question = parsed(entry)
    for option in labelled.option_ids(question):
        label = entry.label_of(option)
        assert labelled.normalize_label(question, label) == option
        assert labelled.normalize_label(question, str(label).upper() if isinstance(label, bool) else label) == option
    with pytest.raises(errors.InvalidLabel) as exc:
        labelled.normalize_label(question, "none of them")
    assert exc.value.field == "labels.q" and entry.name in exc.value.message


@pytest.mark.parametrize("entry", TYPES, ids=IDS)
def test_fit_bands_and_calibration_keys_cover_the_type(entry):
    question = parsed(entry)
    assert entry.name in fit.BANDS_OF and cal.band(len(question.options)) in fit.BANDS_OF[entry.name]
    items = [fit.Item(entry.name, np.array([0.5] * len(question.options)), target=0)]
    table = fit.fit_table(items)
    assert table[entry.name]["n"] == 1 and all(f"{entry.name}.{b}" in table for b in fit.BANDS_OF[entry.name])
    cal.Calibration.build({"bound_to": dict.fromkeys(cal.BOUND_KEYS, "x"),
                           "temperatures": {entry.name: {"temperature": 1.5}}})


@pytest.mark.parametrize("entry", [t for t in TYPES if t.counts], ids=[t.name for t in TYPES if t.counts])
def test_strict_counts_refuse_in_the_entrys_words(entry):
    lo, hi = entry.counts
    for n, cls in ((lo - 1, errors.TooFewOptions), (hi + 1, errors.TooManyOptions)):
        rule = CRITERIA[entry.criteria]
        criteria = {f"o{i}": None for i in range(n)} if isinstance(rule, dict) else [str(i) for i in range(n)]
        body = {"state": "s", "questions": {"q": {"type": entry.name, "criteria": criteria}}}
        parse_request(body)  # the reference answers it
        with pytest.raises(cls) as exc:
            parse_request(body, strict=True)
        assert exc.value.field == "questions.q.criteria" and exc.value.message.startswith("q: ")
        assert any(phrase in exc.value.message for phrase in refusals.KIT_PHRASES)


# ---------------------------------------------------------------- a type nobody registered
def _refused(call, field: str) -> None:
    with pytest.raises(errors.InvalidQuestionType) as exc:
        call()
    assert exc.value.code == "invalid_question_type" and exc.value.field == field
    assert "type must be noul, choice, or score (got 'bogus')" in exc.value.message


def test_an_unknown_type_is_an_error_everywhere():
    _refused(lambda: parse_request({"state": "s", "questions": {"q": {"type": "bogus"}}}), "questions.q.type")
    _refused(lambda: question_type("bogus"), None)
    _refused(lambda: bogus().type_index, "questions.q.type")  # the encoder's type row
    _refused(lambda: answer.answer(bogus(), np.array([0.5, 0.5], dtype=np.float32)), "questions.q.type")
    _refused(lambda: labelled.normalize_label(bogus(), True), "questions.q.type")
    _refused(lambda: fit.Item("bogus", np.zeros(2), target=0), "type")
    _refused(lambda: answer_text.as_text({"answers": {"q": {"type": "bogus"}}}), "answers.q.type")
    _refused(lambda: mcp_server.summary({"answers": {"q": {"type": "bogus"}}, "model": "m"}), "answers.q.type")
    _refused(lambda: refusals.too_few_options("q", "bogus", 1), "questions.q.type")
    with pytest.raises(pydantic.ValidationError):
        pydantic.TypeAdapter(schema.Answers).validate_python({"q": {"type": "bogus"}})
    with pytest.raises(errors.InvalidQuestionType):
        question_type(None)


# ---------------------------------------------------------------- which option won
def test_the_winner_is_the_first_of_tied_maxima_in_the_order_given():
    assert winner([0.2, 0.4, 0.4]) == 1 and winner(np.array([0.4, 0.4, 0.2], dtype=np.float32)) == 0
    assert winner([1.0]) == 0 and winner((0.1, 0.3, 0.2)) == 1


def test_answers_evidence_and_eval_name_the_same_winner():
    # prompt order a, b, c; request order b, a, c; a and b tie: the answer and the evidence name b (the
    # request's first), eval rows (prompt order, as clef-finetune) a.
    question = parse_request({"state": "s", "questions": {"c": {"type": "choice", "criteria": {
        "b": None, "a": None, "c": None}}}}).questions[0]
    p = np.array([0.4, 0.4, 0.2], dtype=np.float32)
    ids = [o.id for o in question.options]
    assert answer.answer(question, p)["choice"] == "b"
    assert ids[evidence_spans.chosen_options([ids], [question.report_order], [p])[0]] == "b"
    row = {"type": "choice", "option_ids": ids, "probs": p.tolist(), "target": 0}
    assert metrics.block([row])["accuracy"] == 1.0  # "a", the first in prompt order
    line = {"questions": {"c": {"option_ids": ids, "probs": p.tolist()}}, "targets": {"c": 0}}
    assert decision_index.Answers([line]).right.tolist() == [1.0]


# ---------------------------------------------------------------- no dispatch outside the registry
REGISTRY = ROOT / "clef_gguf" / "core" / "questions.py"
SOURCES = [p for folder in ("clef_gguf", "heads", "convert", "models") for p in (ROOT / folder).rglob("*.py")]
NAMES = set(QUESTION_TYPES)


def _names_in(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_in(e) for e in node.elts)
    return False


def _dispatch(tree: ast.AST) -> list[tuple[int, str]]:
    """Where a type's name is compared, matched, typed as a Literal, read as an answer's key, or two names
    are keys of one table. A name as a plain value (an example request's ``{"type": "noul"}``) is data."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names_in(n) for n in (node.left, *node.comparators)):
            found.append((node.lineno, "comparison"))
        elif isinstance(node, ast.MatchValue) and _names_in(node.value):
            found.append((node.lineno, "match case"))
        elif isinstance(node, ast.Subscript) and _names_in(node.slice):
            found.append((node.lineno, "Literal[...] or a key read"))
        elif isinstance(node, ast.Dict) and sum(k is not None and _names_in(k) for k in node.keys) > 1:
            found.append((node.lineno, "a per-type table"))  # one such key is data: {"score": 0.875}
    return found


def test_the_check_sees_dispatch():
    code = ('if q.type == "noul": pass\nx = t in ("a", "score")\nT = Literal["choice"]\n'
            'B = {"noul": 1, "choice": 2}\nD = {"score": 0.5}\np = got["noul"]\nmatch k:\n    case "score": pass\n'
            'ok = {"type": "noul", "criteria": None}\n')
    assert [kind for _, kind in _dispatch(ast.parse(code))] == [
        "comparison", "comparison", "Literal[...] or a key read", "a per-type table", "Literal[...] or a key read",
        "match case"]


def test_no_module_outside_the_registry_dispatches_on_a_type_name():
    bad = {str(path.relative_to(ROOT)): found for path in SOURCES if path != REGISTRY
           if (found := _dispatch(ast.parse(path.read_text(encoding="utf-8"))))}
    assert not bad, bad
