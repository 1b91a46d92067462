"""The Ray engine: the same records in and the same output out as the local engine, the model
work spread over ``replicas`` Ray actors of ``threads`` CPUs each (one model copy per actor).

The driver reads the input itself (line numbers, unreadable lines, duplicate ids and resume work
exactly as locally, and only the records left to do are sent) and hands them to Ray Data as JSON
text, so every value reaches the actor as it was read. ``map_batches`` runs ``Decider``: each
actor loads the model once (a directory every node can read, or a catalog name resolved from the
node's Hugging Face cache) and answers whole windows with the local engine's ``results``. The
results stream back in input order (``preserve_order``) and the driver writes each one as it
arrives, through the same output as the local engine: same bytes, same resume.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

from clef_gguf.core import errors
from clef_gguf.bulk import local
from clef_gguf.core.deps import need
from clef_gguf.core.cpus import available_cpus
from clef_gguf.bulk.records import Record
from clef_gguf.media.sources import MediaPolicy
from clef_gguf.runtime.settings import LoadSettings
from clef_gguf.core.children import start_ray

log = logging.getLogger("clef_gguf.bulk")
QUIET_LOGGERS = ("ray", "ray.data", "ray.serve")  # their INFO lines would bury the progress


class Decider:
    """A Ray Data callable class: constructed once per actor, called once per batch."""

    def __init__(self, settings: LoadSettings, window: int, truncate_state: bool,
                 media_policy: MediaPolicy | None = None) -> None:
        from clef_gguf.runtime.model import Clef

        logging.getLogger("clef_gguf.tower.llama").setLevel(logging.ERROR)
        self.clef = Clef.from_settings(settings)
        self.window, self.truncate_state = window, truncate_state
        self.media_policy = media_policy

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        records = [Record(int(i), str(rid), json.loads(req) if req else None,
                          json.loads(err) if err else None)
                   for i, rid, req, err in zip(batch["index"], batch["id"], batch["request"],
                                               batch["error"])]
        out = [json.dumps(r) for r in local.results(self.clef, records, window=self.window,
                                                    truncate_state=self.truncate_state,
                                                    media_policy=self.media_policy)]
        return {"index": batch["index"], "record": np.array(out, dtype=object)}


def run(records: Iterable[Record], write: Callable[[dict], None], *, settings: LoadSettings,
        address: str | None, replicas: int, threads: int, window: int,
        truncate_state: bool, after_init: Callable[[], None] = lambda: None,
        media_policy: MediaPolicy | None = None) -> None:
    """Answer ``records`` on Ray and ``write`` each output record in input order.
    ``after_init`` runs once Ray is up (it takes SIGTERM over: the job puts its handler back).
    ``media_policy`` goes to every actor: a local image path in a record is read there (on a
    cluster, from a directory every node can read, as for the model)."""
    ray = need("ray", "ray")
    need("ray.data", "ray")
    items = [r.transport() for r in records]
    if not items:
        return
    try:
        _init(ray, address, replicas * threads)
        after_init()
        _check_resources(ray, address, replicas, threads)
        import ray.data

        logging.getLogger("ray.data").setLevel(logging.ERROR)  # "progress bars disabled": ours
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True  # results in input order
        context.enable_progress_bars = False  # the job's own progress replaces them
        dataset = ray.data.from_items(items, override_num_blocks=math.ceil(len(items) / window))
        answered = dataset.map_batches(
            Decider, fn_constructor_kwargs={"settings": settings, "window": window,
                                            "truncate_state": truncate_state,
                                            "media_policy": media_policy},
            batch_size=window, batch_format="numpy", num_cpus=threads,
            compute=ray.data.ActorPoolStrategy(size=replicas))
        try:
            for batch in answered.iter_batches(batch_size=None, batch_format="numpy"):
                for text in batch["record"]:
                    write(json.loads(text))
        except Exception as exc:
            cause = _clef_error(exc)
            if cause is not None:  # the model failed to load in the actors: say so plainly
                raise cause from None
            raise
    finally:
        ray.shutdown()


def _init(ray: Any, address: str | None, cpus_needed: int) -> None:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    if address:
        start_ray(ray, address=address, logging_level=logging.WARNING)
        return
    # "local": always a Ray of our own, never one another user of this machine started; as many
    # CPUs as the job asks for, so an oversubscribed job runs (slowly) rather than waits forever
    cpus = max(available_cpus(), cpus_needed)
    # the private Ray's token is ours alone: Ray's notice about it is noise here
    logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)
    start_ray(ray, address="local", num_cpus=cpus, include_dashboard=False,
             logging_level=logging.WARNING)


def _check_resources(ray: Any, address: str | None, replicas: int, threads: int) -> None:
    have = ray.cluster_resources().get("CPU", 0)
    if address and have < replicas * threads:
        # an autoscaling cluster may still grow: say so, but let it try
        log.warning("the Ray cluster has %g CPUs, the job asks for %d replicas x %d threads: "
                    "it waits until the cluster grows", have, replicas, threads)


def _clef_error(exc: BaseException) -> errors.ClefError | None:
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, errors.ClefError):
            return _plain(link)
        link = getattr(link, "cause", None) or link.__cause__
    return None


def _plain(exc: errors.ClefError) -> errors.ClefError:
    """A ClefError of the same code without Ray's wrapper class (its message is Ray's too)."""
    plain = errors.ClefError(exc.message, field=exc.field)
    plain.code, plain.status = exc.code, exc.status
    return plain
