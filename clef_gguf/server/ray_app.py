"""The Ray Serve application for ``serve run`` (Ray's own CLI, e.g. on a cluster):

    serve run clef_gguf.server.ray_app:build model=./demo-model replicas=2 threads=1

Arguments (``key=value``): ``replicas`` (1) and ``queue_size`` (64) of the deployment, and every load
setting of ``clef-gguf serve`` by its name (``runtime.settings.LoadSettings``: ``model``, required,
a directory every node can read or a catalog name resolved from each node's Hugging Face cache;
``threads`` per replica, 1 by default; ``head_threads``, ``max_length``, ``strict``,
``state_cache_mb``, ``backend``, ``head_dtype``, ``calibration``, ``offline``...), each value checked
as its flag is. Catalog names download unless ``offline=true``.
The API key comes from ``$CLEF_GGUF_API_KEY`` on the replicas' nodes, as with ``serve``.
``serve run`` serves on Ray Serve's HTTP port, 8000 by default (``http_options`` in a Serve
config file moves it).
"""

from __future__ import annotations

import os
from typing import Any

from clef_gguf.core import errors
from clef_gguf.runtime.settings import LoadSettings
from clef_gguf.server.app import DEFAULT_QUEUE_SIZE, create_app
from clef_gguf.server.ray_serve import application

DEPLOYMENT = ("replicas", "queue_size")  # the arguments that are not load settings


def build(args: dict[str, str]) -> Any:  # Ray Serve's Application
    if not args.get("model"):
        raise errors.MissingField("give model=DIR or model=CATALOG_NAME", field="model")
    queue_size = int(args.get("queue_size", DEFAULT_QUEUE_SIZE))
    settings = LoadSettings.from_strings({"threads": "1"} | {k: v for k, v in args.items() if k not in DEPLOYMENT})
    app_kwargs = {"api_key": os.environ.get("CLEF_GGUF_API_KEY") or None, "queue_size": queue_size}
    assert settings.threads is not None  # given a default above
    return application(settings, create_app, app_kwargs, replicas=int(args.get("replicas", 1)),
                       threads=settings.threads, queue_size=queue_size)
