"""The Ray Serve application for ``serve run`` (Ray's own CLI, e.g. on a cluster):

    serve run clef_gguf.server.ray_app:build model=./demo-model replicas=2 threads=1

Arguments (``key=value``): ``model`` (required: a directory every node can read, or a catalog
name resolved from each node's Hugging Face cache), ``replicas`` (1), ``threads`` per replica
(1), ``queue_size`` (64), ``max_length`` (the reference window, ``limits.CONTEXT_WINDOW``),
``strict`` (false), ``state_cache_mb`` (512),
``backend`` (auto).
The API key comes from ``$CLEF_GGUF_API_KEY`` on the replicas' nodes, as with ``serve``.
``serve run`` serves on Ray Serve's HTTP port, 8000 by default (``http_options`` in a Serve
config file moves it).
"""

from __future__ import annotations

import os
from typing import Any

from clef_gguf.core import errors
from clef_gguf.tower import cache as statecache
from clef_gguf.core.limits import CONTEXT_WINDOW
from clef_gguf.server.ray_serve import application
from clef_gguf.server.app import DEFAULT_QUEUE_SIZE, create_app


def build(args: dict[str, str]) -> Any:  # Ray Serve's Application
    if not args.get("model"):
        raise errors.MissingField("give model=DIR or model=CATALOG_NAME", field="model")
    queue_size = int(args.get("queue_size", DEFAULT_QUEUE_SIZE))
    threads = int(args.get("threads", 1))
    load = {"model": args["model"], "threads": threads,
            "max_length": int(args.get("max_length", CONTEXT_WINDOW)),
            "strict": args.get("strict", "false").lower() in ("1", "true", "yes"),
            "state_cache_mb": float(args.get("state_cache_mb", statecache.DEFAULT_MB)),
            "backend": args.get("backend", "auto"),
            "allow_download": True}
    app_kwargs = {"api_key": os.environ.get("CLEF_GGUF_API_KEY") or None,
                  "queue_size": queue_size}
    return application(load, create_app, app_kwargs, replicas=int(args.get("replicas", 1)),
                       threads=threads, queue_size=queue_size)
