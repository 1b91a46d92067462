"""The job runner on its own: a real queue and tokenizer stage, a stand-in client, no HTTP."""

import asyncio
import threading

import pytest

from clef_gguf.core import errors
from clef_gguf.server.jobs import JobRunner
from clef_gguf.server.workqueue import InferenceQueue, PrepareStage
from server_helpers import until


class StandIn:
    """A client that leaves when ``leave`` is set; records what the runner notes."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()
        self.facts: dict = {}

    async def disconnected(self) -> bool:
        return self.leave.is_set()

    async def left_before(self, future: asyncio.Future) -> bool:
        gone = asyncio.ensure_future(self.leave.wait())
        try:
            done, _ = await asyncio.wait({future, gone}, return_when=asyncio.FIRST_COMPLETED)
            return future not in done
        finally:
            gone.cancel()

    def note(self, **facts) -> None:
        self.facts.update(facts)


async def _runner(queue_size: int = 1) -> JobRunner:
    queue = InferenceQueue(queue_size)
    stage = PrepareStage(1, queue_size, retry_after=queue.retry_after)
    await queue.start()
    await stage.start()
    return JobRunner(queue, stage)


async def _stop(runner: JobRunner) -> None:
    await runner.stage.stop()
    await runner.queue.stop()


def test_prepare_then_compute_answers_and_notes_the_timings():
    async def main():
        runner = await _runner()
        client = StandIn()
        try:
            doubled = await runner.prepare(client, runner.admit(), lambda x: 2 * x, 21)
            assert await runner.compute(client, lambda _job: doubled + 1) == 43
            assert client.facts["queue_ms"] is not None and client.facts["compute_ms"] is not None
            assert runner.stage.pending == 0
        finally:
            await _stop(runner)

    asyncio.run(main())


def test_refusals_are_registered_errors():
    async def main():
        runner = await _runner(queue_size=1)
        client = StandIn()
        hold = threading.Event()
        try:
            with pytest.raises(errors.ClefError) as info:
                await runner.prepare(client, runner.admit(), _refuse)
            assert info.value.code == "invalid_value" and info.value.status == 422
            running = asyncio.ensure_future(runner.compute(client, lambda _job: hold.wait(30)))
            await until(lambda: runner.queue.busy, "the first job to run")
            queued = asyncio.ensure_future(runner.compute(client, lambda _job: 1))
            await until(lambda: runner.queue.waiting == 1, "the second job to queue")
            with pytest.raises(errors.ClefError) as info:
                await runner.compute(client, lambda _job: 2)
            assert (info.value.status, info.value.code) == (429, errors.ServerBusy.code)
            assert int(info.value.headers["Retry-After"]) >= 1
            hold.set()
            assert await running is True and await queued == 1
        finally:
            hold.set()
            await _stop(runner)
        with pytest.raises(errors.ClefError) as info:
            await runner.compute(client, lambda _job: 3)
        assert (info.value.status, info.value.code) == (503, "shutting_down")

    asyncio.run(main())


def _refuse() -> None:
    raise errors.InvalidValue("no", field="state")


def test_a_client_that_left_is_not_answered_and_its_job_is_dropped():
    async def main():
        runner = await _runner()
        client, ran = StandIn(), []
        hold = threading.Event()
        try:
            first = asyncio.ensure_future(runner.compute(StandIn(), lambda _job: hold.wait(30)))
            await until(lambda: runner.queue.busy, "the first job to run")
            gone = asyncio.ensure_future(runner.compute(client, lambda _job: ran.append(1)))
            await until(lambda: runner.queue.waiting == 1, "the client's job to queue")
            client.leave.set()
            assert await gone is None and client.facts["client_gone"] is True
            hold.set()
            await first
            assert await runner.compute(StandIn(), lambda _job: "next") == "next"
            assert not ran  # the abandoned job never ran
        finally:
            hold.set()
            await _stop(runner)

    asyncio.run(main())
