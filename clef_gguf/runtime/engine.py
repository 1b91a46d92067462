"""Running many requests at once: prepare each, order them, run them in groups, answer in order.

Every path that answers several requests goes through here: ``Clef.decide_many``, the bulk
engines (``bulk/local.py``, which each Ray actor runs too), batch bodies (``server/batch.py``)
and the server's queue when it packs the decisions waiting behind each other
(``server/workqueue.py``). The steps:

1. prepare each request (validate + tokenize); a request refused stays refused in its place;
2. order the prepared ones by ``[prefix][state]``, so requests about one state run one after
   another and the state cache decodes it once (stable: input order within one state);
3. run them through ``Clef.run_many``, whose tower decodes several prompts together where its
   packing policy says it pays (a model that does not pack runs them one by one);
4. hand each outcome back in input order.

One request's failure is that request's alone, whatever it is: a ClefError stays in its place,
and a group whose packed run fails outside one (a bug, or a fault in the tower) runs again one
request at a time, so the fault lands on the request that causes it and the others are answered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from clef_gguf.core import errors
from clef_gguf.pipeline.answer import Decision
from clef_gguf.pipeline.encode import Prepared
from clef_gguf.tower.protocol import check_pack

if TYPE_CHECKING:
    from clef_gguf.media.sources import MediaPolicy

log = logging.getLogger("clef_gguf.runtime.engine")

# Requests prepared and ordered together: enough for the requests about one state in a typical file
# to meet (and reuse its decoded [prefix][state]), few enough to keep memory and latency small.
WINDOW = 64

T = TypeVar("T")
Outcome = Decision | errors.ClefError  # what running one request gave: its decision, or why not


class Model(Protocol):
    """What answers requests: a ``Clef``, or anything that prepares and runs like one (the server
    serves wrappers of a Clef too)."""

    def prepare(self, request: Any, *, truncate_state: bool = False,
                media_policy: MediaPolicy | None = None) -> Prepared: ...

    def run(self, prepared: Prepared) -> Decision: ...


@runtime_checkable
class PackingModel(Model, Protocol):
    """A model whose tower decodes several prompts together (``Clef``)."""

    def pack_size(self, prepared: Prepared) -> int: ...

    def run_many(self, prepared: list[Prepared], *, pack: int | None = None) -> list[Outcome]: ...


def windows(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """``items`` in consecutive lists of ``size`` (the last one may be shorter), read lazily."""
    window: list[T] = []
    for item in items:
        window.append(item)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def as_error(exc: Exception, name: str = "a request") -> errors.ClefError:
    """A request's failure as the ClefError it answers with. One that is not a ClefError is a fault
    of ours (a bug, or the tower's): logged with its traceback, answered as ``internal_error``
    naming the exception."""
    if isinstance(exc, errors.ClefError):
        return exc
    log.error("%s failed", name, exc_info=exc)
    return errors.InternalError(f"{type(exc).__name__}: {exc}")


def attempt(fn: Callable[..., Decision], *args: Any) -> Outcome:
    """``fn(*args)``, or the ClefError it raised (anything else is raised on: a packed pass that
    fails outside one request runs its requests again one at a time, see ``_run_group``)."""
    try:
        return fn(*args)
    except errors.ClefError as exc:
        return exc


def prepare(model: Model, request: Any, *, truncate_state: bool = False,
            media_policy: MediaPolicy | None = None) -> Prepared | errors.ClefError:
    """The request validated and tokenized, or what refused it (kept in the request's place);
    ``media_policy``: where its images may come from (None: the model's default)."""
    try:
        if media_policy is None:
            return model.prepare(request, truncate_state=truncate_state)
        return model.prepare(request, truncate_state=truncate_state, media_policy=media_policy)
    except Exception as exc:  # noqa: BLE001 - this request's failure, answered in its place
        return as_error(exc)


def pack_size(model: Model, prepared: Prepared) -> int:
    """How many prompts like this one the model decodes together (1: one at a time)."""
    return model.pack_size(prepared) if isinstance(model, PackingModel) else 1


def state_key(prepared: Prepared) -> bytes:
    """The prompt's ``[prefix][state]``: requests with equal keys share a state cache entry."""
    enc = prepared.encoded
    return enc.ids[:enc.prefix_tokens + enc.state_tokens].tobytes()


def run(model: Model, prepared: Sequence[Prepared], *, pack: int | None = None,
        stop: Callable[[], bool] | None = None) -> list[Outcome | None]:
    """The outcome of each prepared request, in input order.

    ``pack``: prompts decoded together (None: the tower's policy; 1: one at a time). Without
    ``stop`` everything is one ``run_many``, so the tower fills each packed decode from the
    whole list. With it, the requests run in groups of what the tower decodes together, and
    ``stop()`` is asked before each group: once it says True the rest are left unrun (None)."""
    outcomes: list[Outcome | None] = [None] * len(prepared)
    order = sorted(range(len(prepared)), key=lambda i: state_key(prepared[i]))
    while order:
        if stop is not None and stop():
            break
        size = len(order) if stop is None else _group_size(model, prepared[order[0]], pack)
        group, order = order[:size], order[size:]
        for i, outcome in zip(group, _run_group(model, [prepared[i] for i in group], pack)):
            outcomes[i] = outcome
    return outcomes


def answer(model: Model, requests: Sequence[Any], *, truncate_state: bool = False,
           pack: int | None = None, media_policy: MediaPolicy | None = None) -> list[dict[str, Any]]:
    """One response per request, in input order; a request that fails gives
    ``{"error": {code, message, field}}`` in its place. ``media_policy``: as for ``prepare``."""
    prepared = [prepare(model, request, truncate_state=truncate_state, media_policy=media_policy)
                for request in requests]
    ready = [(i, p) for i, p in enumerate(prepared) if not isinstance(p, errors.ClefError)]
    outcomes: list[Outcome | None] = [p if isinstance(p, errors.ClefError) else None for p in prepared]
    for (i, _), outcome in zip(ready, run(model, [p for _, p in ready], pack=pack)):
        outcomes[i] = outcome
    return [_response(outcome) for outcome in outcomes]


def decide_many(model: Model, requests: Iterable[Any], *, truncate_state: bool = False,
                window: int = WINDOW, pack: int | None = None) -> Iterator[dict[str, Any]]:
    """``answer`` over consecutive windows of ``requests``, read lazily: within each, requests about
    the same state run one after another, so its ``[prefix][state]`` is decoded once."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise errors.InvalidValue(f"window must be a whole number >= 1 (got {window!r})", field="window")
    check_pack(pack)
    for chunk in windows(requests, window):
        yield from answer(model, chunk, truncate_state=truncate_state, pack=pack)


def error_body(exc: Exception, name: str = "a request") -> dict[str, Any]:
    """``{"code", "message", "field"}`` of a failed request (``as_error``'s)."""
    return as_error(exc, name).to_dict()["error"]


def _response(outcome: Outcome | None) -> dict[str, Any]:
    assert outcome is not None, "run leaves a request unrun only when told to stop"
    if isinstance(outcome, errors.ClefError):
        return {"error": outcome.to_dict()["error"]}
    return outcome[0]


def _group_size(model: Model, first: Prepared, pack: int | None) -> int:
    if pack is not None and isinstance(model, PackingModel):
        return pack
    return pack_size(model, first)


def _run_group(model: Model, group: list[Prepared], pack: int | None) -> list[Outcome]:
    if len(group) > 1 and pack != 1 and isinstance(model, PackingModel):
        try:
            return list(model.run_many(group, pack=pack))
        except Exception:  # noqa: BLE001 - a fault in the packed pass: find whose it is
            log.exception("a packed run of %d requests failed; running them one at a time",
                          len(group))
    return [_run_one(model, p) for p in group]


def _run_one(model: Model, prepared: Prepared) -> Outcome:
    try:
        return model.run(prepared)
    except Exception as exc:  # noqa: BLE001 - this request's failure, answered in its place
        return as_error(exc)
