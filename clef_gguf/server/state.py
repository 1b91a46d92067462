"""The one model a server serves, loaded in the background so the port answers at once.

``Served`` is ``loading`` until the load thread ends, then ``ok`` or ``error``; the routes ask it
for the model and get a 503 (with ``Retry-After`` while loading) until it is ready.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from clef_gguf.runtime import engine

from clef_gguf.core.errors import ClefError, ModelLoading, ModelUnavailable

if TYPE_CHECKING:
    from clef_gguf.pipeline.answer import Provenance

log = logging.getLogger("clef_gguf.server")

LOADING_RETRY_AFTER = "2"


class ServedModel(engine.Model, Protocol):
    """A model as the server serves it (a ``Clef``, or a wrapper of one): it answers, and says
    what it is."""

    @property
    def info(self) -> Mapping[str, Any]: ...

    @property
    def provenance(self) -> Provenance | None: ...

    @property
    def models(self) -> Mapping[str, ServedModel]:
        """Every model this one answers through, by name (the base and its fine-tunes)."""
        ...

    def close(self) -> None: ...


class Served:
    """The one model slot: ``loading`` until the background load ends, then ``ok`` or ``error``."""

    def __init__(self, clef: ServedModel | None = None,
                 loader: Callable[[], ServedModel] | None = None,
                 on_load_error: Callable[[ClefError], None] | None = None) -> None:
        self.clef, self.loader, self.on_load_error = clef, loader, on_load_error
        self.owned = clef is None  # we close only what we loaded
        self.error: ClefError | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def status(self) -> str:
        return "ok" if self.clef is not None else "error" if self.error else "loading"

    def load(self) -> None:
        """Runs in a daemon thread so the port answers (``loading``) while weights map in."""
        assert self.loader is not None, "a Served without a model needs a loader"
        try:
            clef = self.loader()
        except ClefError as exc:
            self.error = exc
        except Exception as exc:  # noqa: BLE001 - reported through /health and the exit code
            log.exception("model load failed")
            self.error = ClefError(f"model load failed: {type(exc).__name__}: {exc}")
        else:
            with self._lock:
                if self._closed:  # shut down while loading: nobody will use it
                    clef.close()
                    return
                self.clef = clef
            log.info("model ready: %s", clef.info.get("name"))
            return
        log.error("model load failed: %s", self.error)
        if self.on_load_error is not None:
            self.on_load_error(self.error)

    def start_loading(self) -> None:
        self._thread = threading.Thread(target=self.load, name="clef-load", daemon=True)
        self._thread.start()

    @property
    def still_loading(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_loaded(self, timeout: float) -> bool:
        """Join the load thread (True when it has ended)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.still_loading

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self.owned and self.clef is not None:
                self.clef.close()

    def require(self) -> ServedModel:
        if self.clef is not None:
            return self.clef
        if self.error is not None:
            raise ModelUnavailable(f"the model failed to load: {self.error.message}")
        raise ModelLoading("the model is still loading", retry_after=int(LOADING_RETRY_AFTER))


def loader_for(model: Any, settings: Mapping[str, Any]) -> Callable[[], ServedModel]:
    """A zero-argument loader: ``model`` itself if callable, else the models ``Clef.load(model,
    **settings)`` would load, as ``Models`` (routing a request's ``model``)."""
    if callable(model):
        return model
    from clef_gguf.runtime.model import Clef  # lazy: torch + llama.cpp only once a server starts
    from clef_gguf.runtime.settings import LoadSettings

    return lambda: Clef.from_settings(LoadSettings.of(model=model, **settings))
