"""The Ray Serve application for ``serve run`` (Ray's own CLI, e.g. on a cluster):

    serve run clef_gguf.server.ray_app:build model=./demo-model replicas=2 threads=1

Arguments (``key=value``): ``replicas`` (1), ``queue_size`` (64, or ``$CLEF_GGUF_QUEUE_SIZE``), ``routing``
(``state`` or ``spread``) and ``routing_imbalance`` (4) of the deployment, and every load setting of
``clef-gguf serve`` by its name (``runtime.settings.LoadSettings``: ``model``, required, a directory every
node can read or a catalog name resolved from each node's Hugging Face cache; ``threads`` per replica, 1 by
default; ``head_threads``, ``max_length``, ``strict``, ``state_cache_mb``, ``backend``, ``head_dtype``,
``calibration``, ``offline``...), each value checked as its flag is. Catalog names download unless ``offline=true``.
The server's other settings come from the environment of the process that runs ``serve run``, the
variables ``serve`` reads (``server.settings.ServerSettings``: ``$CLEF_GGUF_API_KEY``,
``$CLEF_GGUF_ALLOWED_HOST``...).
``serve run`` serves on Ray Serve's HTTP port, 8000 by default (``http_options`` in a Serve
config file moves it).
"""

from __future__ import annotations

from typing import Any

from clef_gguf.core import errors
from clef_gguf.runtime.settings import LoadSettings
from clef_gguf.server.app import create_app
from clef_gguf.server.ray_serve import application
from clef_gguf.server.settings import ServerSettings

DEPLOYMENT = ("replicas", "queue_size", "routing", "routing_imbalance")  # the arguments that are not load settings


def build(args: dict[str, str]) -> Any:  # Ray Serve's Application
    if not args.get("model"):
        raise errors.MissingField("give model=DIR or model=CATALOG_NAME", field="model")
    given: dict[str, Any] = {k: int(args[k]) for k in ("queue_size", "routing_imbalance") if k in args}
    given |= {"routing": args["routing"]} if "routing" in args else {}
    server = ServerSettings.from_environment(**given)  # the variables `serve` reads, checked as its flags
    queue_size = server.queue_size
    settings = LoadSettings.from_strings({"threads": "1"} | {k: v for k, v in args.items() if k not in DEPLOYMENT})
    app_kwargs = server.app_kwargs()
    assert settings.threads is not None  # given a default above
    return application(settings, create_app, app_kwargs, replicas=int(args.get("replicas", 1)),
                       threads=settings.threads, queue_size=queue_size, routing=server.routing,
                       imbalance=server.routing_imbalance)
