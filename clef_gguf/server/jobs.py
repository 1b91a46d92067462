"""A request's two waits, and what it is told when either refuses: a tokenizer thread
(``PrepareStage``), then the model's worker (``InferenceQueue``).

The runner knows nothing of HTTP: it talks to the request through :class:`Client` (has it left?
note this fact for its log line), so it runs under a test with a stand-in client as it runs under
the routes. Every refusal leaves here as an error of the one registry, with its headers
(``queue_full`` and ``shutting_down`` with ``Retry-After``, ``client_closed``, the model's own
error, ``internal_error``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from clef_gguf.core import errors
from clef_gguf.server.http import internal_error
from clef_gguf.server.workqueue import Admission, InferenceQueue, Job, PrepareStage

if TYPE_CHECKING:
    from clef_gguf.runtime import engine
    from clef_gguf.pipeline.encode import Prepared

log = logging.getLogger("clef_gguf.server")


class Client(Protocol):
    """The side of a request the runner needs (``http.RequestClient`` for a real one)."""

    async def disconnected(self) -> bool:
        """Whether the client has gone (checked before its turn at a tokenizer)."""
        ...

    async def left_before(self, future: asyncio.Future) -> bool:
        """Wait for ``future``; True if the client disconnected first."""
        ...

    def note(self, **facts: Any) -> None:
        """Facts for the request's log line (tokens, queue_ms, compute_ms, client_gone)."""
        ...


class JobRunner:
    """Admits requests to ``stage``, prepares them there, and runs their jobs on ``queue``."""

    def __init__(self, queue: InferenceQueue, stage: PrepareStage) -> None:
        self.queue, self.stage = queue, stage

    def admit(self) -> Admission:
        """A place in the tokenizer stage, taken before the body is read (when refused, uvicorn
        discards the unread body itself)."""
        return self.stage.admit()

    async def prepare(self, client: Client, admission: Admission, fn: Callable[..., Any],
                      *args: Any) -> Any:
        """``fn(*args)`` on a tokenizer thread (validate + tokenize); releases ``admission``."""
        try:
            return await self.stage.run(admission, fn, *args, gone=client.disconnected)
        except errors.ClientClosed:
            client.note(client_gone=True)
            raise

    async def compute(self, client: Client, fn: Callable[[Job], Any],
                      decision: tuple[engine.Model, Prepared] | None = None) -> Any:
        """Queue ``fn`` on the worker and wait; None if the client left (job dropped).
        ``decision=(clef, prepared)``: ``fn`` is ``clef.run(prepared)``, which the queue may pack
        with the decisions waiting behind it (several prompts per llama_decode, same answers)."""
        job = self.queue.submit(fn, decision=decision)
        try:
            left = await client.left_before(job.future)
        except asyncio.CancelledError:  # uvicorn gave up on this request: never leave it queued
            job.abandon()
            raise
        client.note(queue_ms=job.wait_ms, compute_ms=job.compute_ms)
        if left:
            job.abandon()
            client.note(client_gone=True)
            return None
        try:
            return job.future.result()
        except errors.ServerShuttingDown:  # the queue's, not the model's: no inference failed
            raise
        except errors.ClefError as exc:  # InferenceError (llama_decode failed) included: a 5xx
            log.error("inference failed: %s", exc)
            raise
        except Exception as exc:
            log.exception("inference failed")
            raise internal_error(exc) from None
