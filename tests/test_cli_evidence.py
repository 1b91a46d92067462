"""``"evidence"`` from the command line and the MCP tool, in-process on the tiny model:
``decide --evidence[=occlusion]`` (JSON and ``--format text``), ``batch`` with records that ask for it
(JSONL keeps it, Parquet output refuses that record by name), and the MCP ``decide`` tool."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from clef_gguf.agent.mcp_server import Agent, tools
from clef_gguf.cli import main
from clef_gguf.media.sources import INLINE_ONLY
from clef_gguf.pipeline.answer_text import as_text
from clef_gguf.runtime.model import Clef
from clef_gguf.runtime.registry import Models

FLAGS = ("--threads", "1", "--max-length", "2048")
QUESTIONS = {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
             "team": {"type": "choice", "instructions": "Which team?",
                      "criteria": {"billing": "Payments and refunds", "tech": "Bugs", "sales": "New deals"}}}
STATE = "The app crashes every time I open the invoice page; please fix it today."


@pytest.fixture(scope="module")
def clef(tiny_model_dir):
    with Clef.load(tiny_model_dir, threads=1, max_length=2048) as loaded:
        yield loaded


def decide(model, tmp_path, capsys, *flags: str, body: dict | None = None) -> tuple[int, str]:
    path = tmp_path / "request.json"
    path.write_text(json.dumps(body or {"state": STATE, "questions": QUESTIONS}))
    capsys.readouterr()
    rc = main(["decide", "--model", str(model), *FLAGS, "--request", str(path), *flags])
    return rc, capsys.readouterr().out


def test_decide_evidence_json_and_text(tiny_model_dir, tmp_path, capsys):
    rc, plain = decide(tiny_model_dir, tmp_path, capsys)
    assert rc == 0 and "evidence" not in plain
    rc, out = decide(tiny_model_dir, tmp_path, capsys, "--evidence")
    response = json.loads(out)
    assert rc == 0 and response["answers"] == json.loads(plain)["answers"]
    assert response["evidence"]["mode"] == "attention" and response["audit"]["evidence"] == "attention"
    rc, text = decide(tiny_model_dir, tmp_path, capsys, "--evidence=occlusion", "--format", "text")
    assert rc == 0
    lines = text.splitlines()
    assert lines[0].startswith("urgent: noul p(true)=") and "attention of '" in lines[1]
    assert any(line.strip().startswith("1. '") and "of the state's" in line and "Δp" in line for line in lines)
    assert lines[-1].startswith("occlusion: ") and lines[-1].endswith(" re-runs")
    rc, out = decide(tiny_model_dir, tmp_path, capsys, "--evidence=occlusion",
                     body={"state": STATE, "questions": QUESTIONS, "evidence": {"top": 1}})
    kept = json.loads(out)["evidence"]  # the flag sets the mode, the request's top stays
    assert rc == 0 and kept["mode"] == "occlusion" and all(len(b["spans"]) == 1 for b in kept["questions"].values())
    rc, text = decide(tiny_model_dir, tmp_path, capsys, "--format", "text")
    assert rc == 0 and "attention" not in text and text.startswith("urgent: noul")


def test_decide_refuses_a_bad_mode_and_a_malformed_request_value(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["decide", "--model", str(tiny_model_dir), "--evidence=gradients"])
    assert exit_.value.code == 2
    rc, out = decide(tiny_model_dir, tmp_path, capsys,
                     body={"state": STATE, "questions": QUESTIONS, "evidence": {"top": 100}})
    assert rc == 2 and json.loads(out)["error"]["field"] == "evidence.top"


def test_text_format_of_answers_without_and_with_evidence(clef):
    response = clef.decide({"state": STATE, "questions": QUESTIONS}, evidence={"top": 1})
    text = as_text(response)
    assert text.count("attention of '") == 2 and "1. '" in text and "2. '" not in text


def test_batch_jsonl_keeps_it_and_parquet_refuses_the_record(tiny_model_dir, clef, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"id": f"r{i}", "state": f"{STATE} #{i}", "questions": QUESTIONS,
                                         **({"evidence": True} if i % 2 else {})}) for i in range(4)) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["batch", "--model", str(tiny_model_dir), *FLAGS, "-i", str(src), "-o", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert ["evidence" in r for r in records] == [False, True, False, True]
    direct = clef.decide({"state": f"{STATE} #1", "questions": QUESTIONS, "evidence": True})
    assert records[1]["evidence"] == direct["evidence"] and records[1]["answers"] == direct["answers"]
    table = tmp_path / "out.parquet"
    assert main(["batch", "--model", str(tiny_model_dir), *FLAGS, "-i", str(src), "-o", str(table)]) == 0
    rows = pq.read_table(table).to_pylist()
    assert [row["error_code"] for row in rows] == [None, "invalid_value", None, "invalid_value"]
    assert "JSONL" in json.loads(rows[1]["error"])["message"]


def test_mcp_decide_tool(clef):
    agent = Agent(Models.of(clef), INLINE_ONLY)
    got = agent.decide({"state": STATE, "questions": QUESTIONS, "evidence": {"top": 2}})
    assert got["answers"] == clef.decide({"state": STATE, "questions": QUESTIONS})["answers"]
    assert all(len(b["spans"]) <= 2 for b in got["evidence"]["questions"].values())
    decide_tool = next(t for t in tools() if t.name == "decide")
    assert "evidence" in decide_tool.input_schema["properties"] and "evidence" in decide_tool.description
