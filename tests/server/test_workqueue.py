"""The work queue (``server/workqueue.py``) on fake models: its bound, FIFO order, packing the
decisions that wait behind each other through the engine, and shutdown. Every wait is bounded."""

import asyncio
import threading

import pytest

from clef_gguf.core import errors
from clef_gguf.core.errors import ServerBusy, ServerShuttingDown
from clef_gguf.server.workqueue import InferenceQueue
from engine_helpers import Packing, requests
from server_helpers import until

DEADLINE_S = 30


async def _blocked(queue: InferenceQueue) -> threading.Event:
    """Occupy the worker until the returned event is set."""
    gate, entered = threading.Event(), threading.Event()

    def hold(_job):
        entered.set()
        gate.wait(DEADLINE_S)

    queue.submit(hold)
    assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, DEADLINE_S), \
        "the worker never started the blocking job"
    return gate


def _decide(queue: InferenceQueue, model: Packing, request: dict):
    prepared = model.prepare(request)
    return queue.submit(lambda _job: model.run(prepared), decision=(model, prepared))


def test_the_bound_refuses_with_retry_after_and_shutdown_fails_the_waiting():
    async def scenario():
        queue = InferenceQueue(2)
        with pytest.raises(ServerShuttingDown):
            queue.submit(lambda _job: None)  # not started
        await queue.start()
        gate = await _blocked(queue)
        jobs = [queue.submit(lambda _job, i=i: i) for i in range(2)]
        assert queue.waiting == 2 and queue.waiting_jobs() == tuple(jobs) and queue.busy
        with pytest.raises(ServerBusy) as full:
            queue.submit(lambda _job: None)
        assert 1 <= full.value.retry_after <= 60
        stopping = asyncio.create_task(queue.stop())
        # stop() refuses new jobs and fails the queued ones, then waits for the running job
        await until(lambda: all(job.future.done() for job in jobs), "stop() to fail the queued jobs")
        assert not stopping.done()  # still waiting for the held job
        gate.set()
        await asyncio.wait_for(stopping, DEADLINE_S)
        for job in jobs:
            with pytest.raises(ServerShuttingDown):
                job.future.result()
        with pytest.raises(ServerShuttingDown):
            queue.submit(lambda _job: None)

    asyncio.run(scenario())


def test_decisions_waiting_together_run_as_one_packed_group():
    async def scenario():
        model = Packing(pack=3)
        queue = InferenceQueue(16)
        await queue.start()
        gate = await _blocked(queue)
        reqs = requests("d", "c", "b", "a", "e")
        jobs = [_decide(queue, model, r) for r in reqs[:2]]
        jobs.append(queue.submit(lambda _job: "plain"))  # FIFO: decisions never overtake it
        jobs += [_decide(queue, model, r) for r in reqs[2:]]
        gone = jobs[3]
        gone.abandon()  # the client left while queued: never computed
        gate.set()
        await asyncio.wait_for(asyncio.gather(*(j.future for j in jobs if j is not gone)),
                               DEADLINE_S)
        await queue.stop()
        return model, jobs

    model, jobs = asyncio.run(scenario())
    # [d c] packed, the plain job alone, then [a e] (b was abandoned); each group in state order
    assert model.groups == [["c-1", "d-0"], ["a-3", "e-4"]]
    assert "b-2" not in model.ran
    assert [jobs[i].future.result()[0]["answers"] for i in (0, 1, 4, 5)] == \
        ["d-0", "c-1", "a-3", "e-4"]
    assert jobs[2].future.result() == "plain"


def test_a_fault_in_a_packed_group_fails_only_its_own_job():
    async def scenario():
        model = Packing(pack=4)
        queue = InferenceQueue(16)
        await queue.start()
        gate = await _blocked(queue)
        jobs = [_decide(queue, model, r) for r in requests("x", "boom", "y")]
        gate.set()
        results = await asyncio.wait_for(
            asyncio.gather(*(j.future for j in jobs), return_exceptions=True), DEADLINE_S)
        await queue.stop()
        return model, results

    model, results = asyncio.run(scenario())
    assert model.groups == [["boom-1", "x-0", "y-2"]]
    # its own fault, as the internal_error it is answered with (engine.as_error logged the traceback)
    assert isinstance(results[1], errors.InternalError) and results[1].message == "RuntimeError: tower exploded"
    assert results[0][0]["answers"] == "x-0" and results[2][0]["answers"] == "y-2"
