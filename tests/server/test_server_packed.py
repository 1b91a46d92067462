"""Several prompts per llama_decode in the server, on the tiny model: a batch body through a real
uvicorn server, and the queue packing single decisions that wait behind each other.

The packed answers must be the in-process one-by-one answers; the tower's ``pack_stats`` shows that
prompts really shared a decode. Every wait is bounded; nothing depends on elapsed time.
"""

import asyncio
import dataclasses
import json
import threading

import httpx
import numpy as np
import pytest

from clef_gguf import Clef
from clef_gguf.core import errors
from clef_gguf.server.workqueue import InferenceQueue
from server_helpers import DEADLINE_S, QUESTIONS, ThreadServer, request_body, same


@pytest.fixture(scope="module")
def clef(tiny_model_dir):
    with Clef.load(tiny_model_dir, max_length=2048, threads=2) as model:
        yield model


def expected(clef, body: dict) -> dict:
    return same(clef.decide(json.loads(json.dumps(body))))


def test_a_batch_is_decoded_packed_with_one_by_one_answers(clef):
    inputs = [{"id": str(i), "text": {"ticket": f"Refund {i} not received", "days": i}} for i in range(6)]
    inputs.insert(3, {"id": "bad", "text": "t", "questions": {"q": {"type": "nope"}}})
    clef.tower.pack_stats.clear()
    with ThreadServer(clef, max_batch=16) as server, httpx.Client(base_url=server.url,
                                                                  timeout=DEADLINE_S) as http:
        out = http.post("/v1/systemone", json={"state": inputs, "questions": QUESTIONS}).json()
    assert max(clef.tower.pack_stats) > 1  # the batch's inputs shared decodes
    assert [r["id"] for r in out["results"]] == [e["id"] for e in inputs]
    bad = out["results"].pop(3)
    assert bad["error"]["code"] == "invalid_question_type"
    for result, entry in zip(out["results"], [e for e in inputs if e["id"] != "bad"]):
        assert result["answers"] == expected(clef, {"state": entry["text"], "questions": QUESTIONS})["answers"]


async def _queued(clef, bodies: list, *, broken: int | None = None, other_at: int | None = None):
    """Submit a blocking job, then one decision job per body (``broken``: that one's ids are outside
    the vocab; ``other_at``: a plain job queued at that place), release the block, await all."""
    queue = InferenceQueue(32)
    await queue.start()
    gate, entered = threading.Event(), threading.Event()

    def hold(_job):
        entered.set()
        gate.wait(DEADLINE_S)

    jobs = [queue.submit(hold)]
    await asyncio.get_running_loop().run_in_executor(None, entered.wait, DEADLINE_S)
    for i, body in enumerate(bodies):
        if i == other_at:
            jobs.append(queue.submit(lambda _job: "plain"))
        prepared = clef.prepare(body)
        if i == broken:
            enc = dataclasses.replace(prepared.encoded, ids=np.full_like(prepared.encoded.ids, 10**6))
            prepared = dataclasses.replace(prepared, encoded=enc)
        jobs.append(queue.submit(lambda _job, p=prepared: clef.run(p), decision=(clef, prepared)))
    gate.set()
    results = await asyncio.gather(*(job.future for job in jobs[1:]), return_exceptions=True)
    await queue.stop()
    return results


def test_queued_decisions_run_packed_with_one_by_one_answers(clef):
    bodies = [request_body(i) for i in range(5)]
    clef.tower.pack_stats.clear()
    results = asyncio.run(_queued(clef, bodies))
    assert max(clef.tower.pack_stats) > 1  # decisions that waited together shared decodes
    for (response, timings), body in zip(results, bodies):
        assert same(response) == expected(clef, body) and timings["tokens"] > 0


def test_a_failing_decision_fails_alone_and_plain_jobs_keep_their_turn(clef):
    bodies = [request_body(i) for i in range(10, 15)]
    results = asyncio.run(_queued(clef, bodies, broken=1, other_at=3))
    assert isinstance(results[1], errors.InferenceError)
    assert results[3] == "plain"  # FIFO: the decisions behind it were not taken ahead of it
    answered = [r for i, r in enumerate(results) if i not in (1, 3)]
    for (response, _), body in zip(answered, [b for i, b in enumerate(bodies) if i != 1]):
        assert same(response) == expected(clef, body)
