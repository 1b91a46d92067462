"""The server's own settings, as one typed object: ``ServerSettings``, declared once.

``clef-gguf serve``'s flags beyond the load flags are generated from it (``core.commandline``), and
``clef-gguf ui``'s are the same declaration with its overrides (``server.ui_command``): a free port by
default, no ``--no-ui``. Each setting may also come from the environment, ``$CLEF_GGUF_`` and its flag's
name (``--port`` -> ``CLEF_GGUF_PORT``, ``--api-key`` -> ``CLEF_GGUF_API_KEY``): a flag given wins over
its variable, a variable over the default. ``app_kwargs`` is the one place the settings become
``create_app``'s keywords, for ``serve``, ``ui``, ``serve --engine ray-serve`` and Ray's ``serve run``.
"""

from __future__ import annotations

import argparse
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field

from clef_gguf.core import argtypes
from clef_gguf.core.limits import MiB
from clef_gguf.core.commandline import GIVEN, CommandSettings, Flag
from clef_gguf.media.sources import MediaPolicy, file_roots_help, served_sources
from clef_gguf.server.guard import SitePolicy, allowed_host, cors_origin

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_QUEUE_SIZE = 64  # waiting requests: room for 32+ busy clients; past that 429 beats
#                          letting latency grow without bound
# A full 16k-token state is ~100 KB; images come inline, base64 (4/3 of their bytes): 32 MiB holds
# a few phone photos or a batch of screenshots.
DEFAULT_MAX_BODY = 32 * MiB
DEFAULT_MAX_BATCH = 256
# Tokenizing is CPU work next to the model's own threads: two keep a burst of small requests
# moving without taking the cores a forward pass needs.
DEFAULT_TOKENIZE_WORKERS = 2
# At SIGTERM, how long open requests may take to finish: one 16k-token pass of the 9B model on a
# CPU takes minutes; cutting it short would throw that work away.
DEFAULT_DRAIN_S = 300.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# --routing state: requests in flight a state's replica may have beyond the least busy one's. A 9B decision
# on a CPU takes seconds: four waiting behind one replica while another idles is worth a cold state.
DEFAULT_IMBALANCE = 4

Whole = Annotated[int, pydantic.Strict(), Field(ge=1)]  # True is not a queue size
Entries = tuple[str, ...]  # a repeatable flag's values


class ServerSettings(CommandSettings):
    """What ``serve`` runs with beyond the model: where it listens, who may call it, its bounds."""

    flag_group = "server"
    flag_group_help = (
        "Each flag may also be set by the environment variable in brackets: a flag given wins over its "
        "variable, a variable over the default. A repeatable flag's variable takes a comma-separated "
        "list, a switch's 1/true/yes/on or 0/false/no/off; an empty variable is unset.")
    env_prefix = "CLEF_GGUF_"

    host: str = Field(default=DEFAULT_HOST, description="address to bind (default 127.0.0.1: this machine only)")
    port: Annotated[int, pydantic.Strict(), Field(ge=0, le=65535), Flag(type=argtypes.port)] = Field(
        default=DEFAULT_PORT, description=f"port (default {DEFAULT_PORT})")
    api_key: str | None = Field(default=None, repr=False, description=(
        "require the key on every endpoint but /health and the page, as 'Authorization: Bearer KEY' or "
        "'X-API-Key: KEY' (default: none; prefer the variable to the flag: argv is visible in ps)"))
    allowed_hosts: Annotated[Entries, Flag(("--allowed-host",), action="append", type=allowed_host,
                                           metavar="NAME[:PORT]|*")] = Field(default=(), description=(
        "also answer requests whose Host header names NAME (any port) or NAME:PORT; repeatable. Default: "
        "localhost, 127.0.0.1, [::1] and the address a client connected to, on this server's port; others "
        "get 421 host_not_allowed (a web page re-pointing its DNS name here cannot read answers). * answers "
        "any Host (not advised on a desktop)"))
    cors_origins: Annotated[Entries, Flag(("--cors-origin",), action="append", type=cors_origin,
                                          metavar="URL")] = Field(default=(), description=(
        "let web pages on this origin (http://127.0.0.1:3000) call the API: their CORS preflights are "
        "answered and their requests run; repeatable. Default: none; a request from any other page's "
        "origin gets 403 origin_not_allowed, and a browser must post application/json"))
    no_ui: Annotated[bool, Flag(action="store_true")] = Field(default=False, description=(
        "do not serve the playground page on GET / (the API only)"))
    queue_size: Annotated[Whole, Flag(type=argtypes.positive_int)] = Field(default=DEFAULT_QUEUE_SIZE, description=(
        "requests that may wait for the model, and as many again for a tokenizer thread; more get 429 + "
        f"Retry-After (default {DEFAULT_QUEUE_SIZE})"))
    tokenize_workers: Annotated[Whole, Flag(type=argtypes.positive_int)] = Field(
        default=DEFAULT_TOKENIZE_WORKERS, description=(
            "requests validated + tokenized at once, each in a thread of its own "
            f"(default {DEFAULT_TOKENIZE_WORKERS})"))
    drain_timeout: Annotated[float, Field(ge=0, allow_inf_nan=False),
                             Flag(type=argtypes.seconds, metavar="SECONDS")] = Field(
        default=DEFAULT_DRAIN_S, description=(
            "at SIGTERM / Ctrl-C, how long open requests may take to finish before they are cut off "
            f"(default {DEFAULT_DRAIN_S:g}: one 16k-token pass of a 9B model on a CPU)"))
    max_body_bytes: Annotated[Whole, Flag(type=argtypes.positive_int)] = Field(default=DEFAULT_MAX_BODY, description=(
        f"larger request bodies get 413 (default {DEFAULT_MAX_BODY})"))
    media_allow_url: Annotated[Entries, Flag(action="append", metavar="HOST|PREFIX|*")] = Field(
        default=(), description=(
            "let requests name images by URL on this host (example.com, .example.com for its subdomains "
            "too, host:port), under this URL prefix (https://cdn.example.com/img/), or * for any; "
            "repeatable. Default: no fetching (data: URIs and base64 only): a server that fetches what a "
            "request names is an SSRF hole"))
    media_allow_files: Annotated[Entries, Flag(action="append", nargs="?", const=".", metavar="DIR")] = Field(
        default=(), description=file_roots_help("refused (unsupported_media_source)"))
    max_batch: Annotated[Whole, Flag(type=argtypes.positive_int)] = Field(default=DEFAULT_MAX_BATCH, description=(
        f"inputs per batch request (default {DEFAULT_MAX_BATCH})"))
    engine: Literal["uvicorn", "ray-serve"] = Field(default="uvicorn", description=(
        "uvicorn (default): this process; ray-serve: --replicas Ray Serve replicas of this app, one model "
        "copy each, --threads threads each (Ray from $RAY_ADDRESS, else a private one; pip install "
        "'clef-gguf[ray]')"))
    replicas: Annotated[Whole, Flag(type=argtypes.positive_int)] = Field(default=1, description=(
        "with --engine ray-serve: model replicas (default 1)"))
    routing: Literal["state", "spread"] = Field(default="state", description=(
        "with --engine ray-serve: which replica answers a request. state (default): the one holding its "
        "state (the request's state and pictures, hashed), so its state cache hits as in one process; "
        "spread: Ray Serve's own rule, the less busy of two replicas drawn at random"))
    routing_imbalance: Annotated[int, pydantic.Strict(), Field(ge=0), Flag(type=argtypes.non_negative_int)] = Field(
        default=DEFAULT_IMBALANCE, description=(
            "with --routing state: how many more requests in flight a request's replica may have than the "
            f"least busy one before the request goes to the least busy one instead (default {DEFAULT_IMBALANCE})"))

    @property
    def site(self) -> SitePolicy:
        """The Host names and page origins the server answers to beyond its defaults."""
        return SitePolicy(self.allowed_hosts, self.cors_origins)

    @property
    def media_policy(self) -> MediaPolicy:
        """Where requests' images may come from; a --media-allow-files DIR that is no directory is refused."""
        return served_sources(self)

    @property
    def loopback_only(self) -> bool:
        return self.host in LOOPBACK_HOSTS

    def app_kwargs(self) -> dict[str, Any]:
        """``create_app``'s keywords: the one place the settings become the app, for ``serve``, ``ui``
        and every Ray Serve replica."""
        return {"api_key": self.api_key, "queue_size": self.queue_size, "max_body_bytes": self.max_body_bytes,
                "max_batch": self.max_batch, "tokenize_workers": self.tokenize_workers, "ui": not self.no_ui,
                "media_policy": self.media_policy, "site": self.site}

    def onto(self, args: argparse.Namespace) -> argparse.Namespace:
        """A copy of ``args`` whose server flags say these settings, each counted as given (so
        ``from_args`` of it gives them back): for code that still reads the flags themselves."""
        out = argparse.Namespace(**vars(args))
        for name in type(self).model_fields:
            setattr(out, name, getattr(self, name))
        setattr(out, GIVEN, getattr(args, GIVEN, frozenset()) | set(type(self).model_fields))
        return out
