"""The bounded queue in front of the one model, and the single worker thread that runs it.

Why one worker thread: the model is one llama.cpp context plus one head; ``Clef.run`` holds a lock
anyway, and llama.cpp already spreads a forward pass over all cores, so running two passes at
once would only make both slower. Why a bounded queue: a local server that accepts everything
grows its latency without limit under overload; refusing early with 429 + ``Retry-After`` lets
clients back off (avrik-sdk retries on exactly that).

The queue lives on the event loop (a deque of our own, so the dispatcher can look at the jobs
behind the one it takes); a dispatcher task takes one job at a time and runs it in the worker
thread, so the event loop never blocks on inference. A job submitted with
``decision=(clef, prepared)`` is one decision: the dispatcher takes it together with the decisions
queued right behind it, up to what the tower's packing policy packs for that prompt
(``Clef.pack_size``), and runs them through ``clef_gguf.runtime.engine`` (several prompts per
llama_decode, the same answers as one by one, each failure its own job's).

In front of the queue, :class:`PrepareStage` bounds validation + tokenization the same way: a few
threads of its own and a capped number of requests waiting for them (see its docstring).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from clef_gguf.core import errors
from clef_gguf.runtime import engine

if TYPE_CHECKING:
    from clef_gguf.pipeline.encode import Prepared

log = logging.getLogger("clef_gguf.server")


def _stopping() -> errors.ServerShuttingDown:
    return errors.ServerShuttingDown("the server is shutting down")


class Job:
    """One unit of work: ``fn()`` runs in the worker thread; the caller awaits ``future``.

    ``abandon()`` is called when the client went away. A job still queued is then skipped (never
    computed); a job already running finishes and its result is thrown away. Long jobs (batches)
    may poll ``abandoned`` between items to stop early.
    """

    __slots__ = ("fn", "future", "abandoned", "enqueued", "started", "finished", "decision")

    def __init__(self, fn: Callable[[Job], Any], future: asyncio.Future,
                 decision: tuple[engine.Model, Prepared] | None = None) -> None:
        self.fn = fn
        self.future = future
        self.decision = decision  # (clef, prepared): ``fn`` is clef.run(prepared), packable
        self.abandoned = False
        self.enqueued = time.perf_counter()
        self.started: float | None = None
        self.finished: float | None = None

    def abandon(self) -> None:
        self.abandoned = True

    @property
    def wait_ms(self) -> float | None:
        """Time spent queued, or None if it never started."""
        return None if self.started is None else (self.started - self.enqueued) * 1000.0

    @property
    def compute_ms(self) -> float | None:
        if self.started is None or self.finished is None:
            return None
        return (self.finished - self.started) * 1000.0


class InferenceQueue:
    """``maxsize`` jobs may wait while one runs; more are refused with ``errors.ServerBusy``."""

    def __init__(self, maxsize: int, *, thread_name: str = "clef-worker") -> None:
        if maxsize < 1:
            raise ValueError("queue size must be at least 1")
        self.maxsize = maxsize
        self._thread_name = thread_name
        self._waiting: deque[Job] = deque()
        # Set while jobs wait; an Event rather than a Condition because ``submit`` is synchronous
        # (a Condition's notify needs its lock, which is taken with ``await``).
        self._arrived: asyncio.Event | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._dispatcher: asyncio.Task | None = None
        self._running: Job | None = None
        self._closed = False
        # Smoothed seconds per job, only to size Retry-After; starts at a guess of 1 s.
        self._avg_job_s = 1.0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Create the queue and the worker; call from the event loop that will use them."""
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=self._thread_name)
        self._dispatcher = asyncio.create_task(self._dispatch(), name="clef-dispatcher")

    async def stop(self) -> None:
        """Refuse new jobs, let the running job finish, fail the queued ones, stop the thread.

        uvicorn calls this (through the app's lifespan) only after it has stopped accepting
        connections and waited for open requests, so normally the queue is already empty here.
        """
        self._closed = True
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            try:
                await self._dispatcher
            except asyncio.CancelledError:
                pass
        while self._waiting:
            self._settle(self._waiting.popleft(), exc=_stopping())
        if self._executor is not None:
            # Waits for a pass already inside the model: never leave llama.cpp mid-decode.
            await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self._executor.shutdown, wait=True))

    # ------------------------------------------------------------------ use
    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def waiting_jobs(self) -> tuple[Job, ...]:
        """A snapshot of the queued jobs, oldest first (for tests and diagnostics)."""
        return tuple(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def retry_after(self) -> int:
        """Whole seconds until the queue has probably drained (HTTP wants delay-seconds)."""
        backlog = self.waiting + (1 if self.busy else 0)
        return max(1, min(60, math.ceil(backlog * self._avg_job_s)))

    def submit(self, fn: Callable[[Job], Any], *,
               decision: tuple[engine.Model, Prepared] | None = None) -> Job:
        """Queue ``fn`` (it receives its :class:`Job`); ServerBusy or ServerShuttingDown at once.
        ``decision=(clef, prepared)`` says ``fn`` is ``clef.run(prepared)``: it may then run packed
        with the decisions queued behind it, its result the same."""
        if self._closed or self._arrived is None:
            raise _stopping()
        job = Job(fn, asyncio.get_running_loop().create_future(), decision)
        if len(self._waiting) >= self.maxsize:
            raise errors.ServerBusy(f"{self.maxsize} requests are already waiting for the model; "
                                    "retry later", retry_after=self.retry_after())
        self._waiting.append(job)
        self._arrived.set()
        return job

    async def _next(self) -> Job:
        """The oldest waiting job, once there is one."""
        assert self._arrived is not None
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        return self._waiting.popleft()

    async def _dispatch(self) -> None:
        assert self._executor is not None
        loop = asyncio.get_running_loop()
        while True:
            job = await self._next()
            if job.abandoned or job.future.done():
                continue  # the client left while queued: drop it without computing
            packed = self._packable_behind(job)
            if packed is not None:
                await self._run_group(*packed)
                continue
            self._running = job
            job.started = time.perf_counter()
            try:
                result = await loop.run_in_executor(self._executor, job.fn, job)
            except asyncio.CancelledError:
                # Shutdown while a pass runs: stop() waits for the thread; the waiter is told.
                self._settle(job, exc=_stopping())
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the request that owns it
                job.finished = time.perf_counter()
                self._settle(job, exc=exc)
            else:
                job.finished = time.perf_counter()
                self._settle(job, result=result)
            finally:
                self._running = None
            seconds = (job.finished - job.started) if job.finished else self._avg_job_s
            self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * seconds

    def _packable_behind(self, job: Job) -> tuple[engine.Model, list[tuple[Job, Prepared]]] | None:
        """``job``'s model, and ``job`` with the decisions for that model queued right behind it,
        as many as its tower packs for prompts of this size (FIFO: never one from behind another
        kind of job); None when ``job`` runs alone."""
        if job.decision is None:
            return None
        model, prepared = job.decision
        limit = engine.pack_size(model, prepared)
        group = [(job, prepared)]
        while len(group) < limit and self._waiting:
            nxt = self._waiting[0]
            if nxt.abandoned or nxt.future.done():
                self._waiting.popleft()  # dropped, as _dispatch would
                continue
            if nxt.decision is None or nxt.decision[0] is not model \
                    or engine.pack_size(*nxt.decision) < 2:
                break
            group.append((self._waiting.popleft(), nxt.decision[1]))
        return (model, group) if len(group) > 1 else None

    async def _run_group(self, model: engine.Model, group: list[tuple[Job, Prepared]]) -> None:
        jobs = [job for job, _ in group]
        self._running = jobs[0]
        started = time.perf_counter()
        for job in jobs:
            job.started = started
        loop = asyncio.get_running_loop()
        results: list[engine.Outcome | BaseException | None]
        try:
            results = list(await loop.run_in_executor(self._executor, engine.run, model,
                                                      [prepared for _, prepared in group]))
        except asyncio.CancelledError:
            for job in jobs:
                self._settle(job, exc=_stopping())
            raise
        except BaseException as exc:  # noqa: BLE001 - engine.run keeps each Exception in its
            results = [exc] * len(jobs)  # job's place; anything else reaches every owner
        finally:
            self._running = None
        finished = time.perf_counter()
        for job, result in zip(jobs, results):
            job.finished = finished
            if isinstance(result, BaseException):
                self._settle(job, exc=result)
            else:
                self._settle(job, result=result)
        self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * (finished - started) / len(jobs)

    @staticmethod
    def _settle(job: Job, *, result: Any = None, exc: BaseException | None = None) -> None:
        if job.future.done():
            return
        if job.abandoned:
            job.future.cancel()  # nobody awaits it: no "exception never retrieved" noise
        elif exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)


class Admission:
    """A request's place in :class:`PrepareStage`, held from before its body is read until its
    prepare ends. ``release`` is idempotent, so every exit path may call it."""

    __slots__ = ("_held", "_stage")

    def __init__(self, stage: PrepareStage) -> None:
        self._stage, self._held = stage, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._stage._pending -= 1


class PrepareStage:
    """Validation + tokenization (``Clef.prepare``): ``workers`` at once, in threads of their own;
    at most ``max_waiting`` more requests wait for a turn, beyond that :meth:`admit` raises
    ``errors.ServerBusy``.

    Why: Starlette's threadpool would run up to 40 prepares at once, outside the model's bounded
    queue, so a flood of large requests would hold every body and its tokens in memory at once
    and starve the model's own threads of CPU. A request is admitted *before* its body is read,
    so bodies being received count against the bound too. Everything runs on one event loop, so
    the counters need no lock.
    """

    def __init__(self, workers: int, max_waiting: int, *,
                 retry_after: Callable[[], int] = lambda: 1,
                 thread_name: str = "clef-prepare") -> None:
        if workers < 1 or max_waiting < 0:
            raise ValueError("need at least 1 tokenize worker and max_waiting >= 0")
        self.workers, self.max_waiting = workers, max_waiting
        self._retry_after = retry_after
        self._thread_name = thread_name
        self._pending = 0  # admitted and not yet released: receiving, waiting or preparing
        self.running = 0  # prepares inside a thread now
        self._semaphore: asyncio.Semaphore | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        return self._pending

    async def start(self) -> None:
        self._semaphore = asyncio.Semaphore(self.workers)
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix=self._thread_name)

    async def stop(self) -> None:
        self._closed = True
        if self._executor is not None:
            # A tokenizer call cannot be interrupted; waiting keeps its thread out of shutdown.
            await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self._executor.shutdown, wait=True, cancel_futures=True))

    def admit(self) -> Admission:
        """A place for one request, or ServerBusy / ServerShuttingDown at once."""
        if self._closed or self._semaphore is None:
            raise _stopping()
        if self._pending >= self.workers + self.max_waiting:
            raise errors.ServerBusy(f"{self.max_waiting} requests are already waiting to be "
                                    "tokenized; retry later", retry_after=self._retry_after())
        self._pending += 1
        return Admission(self)

    async def run(self, admission: Admission, fn: Callable[..., Any], *args: Any,
                  gone: Callable[[], Awaitable[bool]] | None = None) -> Any:
        """``fn(*args)`` in a tokenizer thread once one is free; releases ``admission`` either
        way. ``gone``: checked once a thread is free, so a client that left is not prepared."""
        assert self._semaphore is not None and self._executor is not None
        try:
            async with self._semaphore:
                if gone is not None and await gone():
                    raise errors.ClientClosed("the client disconnected")
                self.running += 1
                try:
                    return await asyncio.get_running_loop().run_in_executor(
                        self._executor, fn, *args)
                finally:
                    self.running -= 1
        finally:
            admission.release()
