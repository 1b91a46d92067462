"""The set of models one process serves, apart from the model (llama-cpp-python's server keeps the
same split): a base ``Clef`` and its fine-tunes by name, which one answers by default, and routing
by a request's ``model``.

Routing follows the reference, which ignores ``model``: a name served here (the base, a fine-tune, or
the base's family name such as ``clef-flash``, which clients send) picks that model; any other name
is answered by the default model, with a ``warnings`` entry saying so (one model: no warning, as the
reference), and refused when strict, with one model or several (``unknown_model``, 404). A ``Clef``
itself never routes: a model you hold answers as itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from clef_gguf.core import errors
from clef_gguf.pipeline.encode import Prepared
from clef_gguf.pipeline.evidence import with_evidence
from clef_gguf.runtime import engine

if TYPE_CHECKING:
    from clef_gguf.media.sources import MediaPolicy
    from clef_gguf.pipeline.answer import Decision, Provenance
    from clef_gguf.tower.cache import StateCache


class Member(engine.PackingModel, Protocol):
    """One model of the set: what ``Clef`` is to the registry (typed here, not imported: ``Clef.load``
    returns a registry, so the model's module imports this one)."""

    @property
    def name(self) -> str: ...

    @property
    def info(self) -> Mapping[str, Any]: ...

    provenance: Provenance
    state_cache: StateCache

    def prepare(self, request: Any, *, truncate_state: bool = False, strict: bool | None = None,
                media_policy: MediaPolicy | None = None) -> Prepared: ...

    def probabilities(self, request: Any, *, truncate_state: bool = False) -> list[np.ndarray]: ...

    def calibration_binding(self) -> dict[str, str | None]: ...

    def close(self) -> None: ...


M = TypeVar("M", bound=Member)


def named_model(request: Any) -> str | None:
    """The ``model`` a request body names, if it is a string (``parse_request`` checks the rest)."""
    name = request.get("model") if isinstance(request, dict) else None
    return name if isinstance(name, str) else None


class Described(Protocol):
    """A served model as a listing sees it: what it says about itself."""

    @property
    def info(self) -> Mapping[str, Any]: ...


def model_entries(models: Mapping[str, Described], default: str | None) -> list[dict[str, Any]]:
    """What a process serving ``models`` lists (``GET /v1/models``, the MCP ``models`` tool): each
    model's ``info``, its name first and whether a request naming no model gets it; the default
    first (what a client picks when it takes the first), then the others by name."""
    entries = []
    for name, model in sorted(models.items(), key=lambda item: (item[0] != default, item[0])):
        info = dict(model.info)
        entries.append({"name": info.pop("name"), **info, "default": name == default})
    return entries


def family_of(model_name: str) -> str | None:
    """The catalog family a model's name says it is (``clef-flash:Q4_K_M@...`` -> ``clef-flash``)."""
    from clef_gguf.models.catalog import load_catalog

    found = [f for f in load_catalog().families
             if model_name == f or model_name.startswith((f"{f}:", f"{f}@"))]
    return max(found, key=len, default=None)


class Models(Mapping[str, M]):
    """Name -> ``Clef`` for every model of one loaded tower; answers requests by routing them."""

    def __init__(self, base: M, fine_tunes: Mapping[str, M] | None = None, *,
                 default: str | None = None, strict: bool = False) -> None:
        self.base = base
        self.models: dict[str, M] = {base.name: base, **(fine_tunes or {})}
        self.default = default if default is not None else base.name
        if self.default not in self.models:
            raise errors.InvalidSetting(f"the default model {self.default!r} is not loaded", field="model")
        family = family_of(base.name)
        # The name clients send for "the Clef model" answers as a request naming none does (the default,
        # a bare --adapter's fine-tune included); a fine-tune's own name wins over the alias.
        self.aliases = {family: self.default} if family and family not in self.models else {}
        self.strict = strict

    @classmethod
    def of(cls, loaded: M | Models[M]) -> Models[M]:
        """``loaded`` as a set of models: a single ``Clef`` is the set of that one."""
        return loaded if isinstance(loaded, Models) else cls(loaded, strict=getattr(loaded, "strict", False))

    # ------------------------------------------------------------ the mapping
    def __getitem__(self, name: str) -> M:
        return self.models[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    @property
    def default_model(self) -> M:
        return self.models[self.default]

    @property
    def info(self) -> Mapping[str, Any]:
        return self.default_model.info

    @property
    def provenance(self) -> Provenance:
        return self.default_model.provenance

    @property
    def state_cache(self) -> StateCache:
        return self.base.state_cache  # one cache, keyed per adapter

    # ------------------------------------------------------------ routing
    def route(self, name: str | None, *, strict: bool | None = None) -> tuple[M, dict[str, str] | None]:
        """The model a request's ``model`` names, and the warning to answer with (None: none). With
        one model there is nothing to choose: any name is answered by it and echoed, without a warning,
        unless strict, which refuses a name not served here whatever the number of models."""
        if name is None:
            return self.default_model, None
        found = self.models.get(self.aliases.get(name, name))
        if found is not None:
            return found, None
        served = ", ".join(sorted([*self.models, *self.aliases]))
        if self.strict if strict is None else strict:
            raise errors.UnknownModel(f"no model named {name!r} here; this process serves {served}",
                                      field="model")
        if len(self.models) == 1:
            return self.default_model, None
        return self.default_model, {
            "code": "unknown_model", "field": "model",
            "message": f"no model named {name!r} here: answered by {self.default} (this process "
                       f"serves {served})"}

    def prepare(self, request: Any, *, truncate_state: bool = False, strict: bool | None = None,
                media_policy: MediaPolicy | None = None) -> Prepared:
        """``Clef.prepare`` by the model a request's ``model`` names (the default model without one).

        Args:
            request, truncate_state, strict, media_policy: as ``Clef.prepare``'s.

        Returns:
            The ``Prepared`` request, with the routing's warning first in its ``warnings`` when its
            ``model`` named no model served here and the default answered.

        Raises:
            UnknownModel: strict, and ``model`` names no model served here.
            InvalidRequest, ContextTooLarge, MediaTooLarge: as ``Clef.prepare``.
        """
        model, warning = self.route(named_model(request), strict=strict)
        prepared = model.prepare(request, truncate_state=truncate_state, strict=strict,
                                 media_policy=media_policy)
        if warning is None:
            return prepared
        parsed = dataclasses.replace(prepared.request, warnings=(warning,) + prepared.request.warnings)
        return dataclasses.replace(prepared, request=parsed)

    def answering(self, prepared: Prepared) -> M:
        """The model ``prepared`` was prepared by."""
        return self.models[prepared.model]

    # ------------------------------------------------------------ answering
    def run(self, prepared: Prepared) -> Decision:
        """``Clef.run`` by the model that prepared ``prepared``.

        Returns:
            The ``Decision`` (the response and the time per stage).

        Raises:
            InferenceError: as ``Clef.run``.
        """
        return self.answering(prepared).run(prepared)

    def pack_size(self, prepared: Prepared) -> int:
        return self.answering(prepared).pack_size(prepared)

    def run_many(self, prepared: list[Prepared], *, pack: int | None = None) -> list[engine.Outcome]:
        """``Clef.run_many`` per model (one decode applies one adapter), outcomes in input order."""
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prepared):
            groups.setdefault(p.model, []).append(i)
        out: list[engine.Outcome | None] = [None] * len(prepared)
        for name, where in groups.items():
            for i, outcome in zip(where, self.models[name].run_many([prepared[i] for i in where], pack=pack)):
                out[i] = outcome
        return [o for o in out if o is not None]

    def decide(self, request: Any, *, truncate_state: bool = False, strict: bool | None = None,
               evidence: bool | dict[str, Any] | None = None) -> dict:
        """``Clef.decide``, routed by the request's ``model``.

        Args:
            request, truncate_state, strict, evidence: as ``Clef.decide``'s.

        Returns:
            The SystemOne response dict of the model that answered.

        Raises:
            UnknownModel: as :meth:`prepare`.
            InvalidRequest, ContextTooLarge, MediaTooLarge, InferenceError: as ``Clef.decide``.
        """
        request = with_evidence(request, evidence)
        return self.run(self.prepare(request, truncate_state=truncate_state, strict=strict)).response

    def decide_many(self, requests: Iterable[Any], *, truncate_state: bool = False,
                    window: int = engine.WINDOW, pack: int | None = None) -> Iterator[dict]:
        """``Clef.decide_many``, each request routed by its ``model``.

        Args:
            requests, truncate_state, window, pack: as ``Clef.decide_many``'s.

        Returns:
            A generator of one response dict per request, in input order; a failed request (an
            ``unknown_model`` refusal included) gives its ``{"error": ...}`` in its place.

        Raises:
            InvalidValue: as ``Clef.decide_many``.
        """
        return engine.decide_many(self, requests, truncate_state=truncate_state, window=window, pack=pack)

    def probabilities(self, request: Any, *, truncate_state: bool = False) -> list[np.ndarray]:
        model, _ = self.route(named_model(request))
        return model.probabilities(request, truncate_state=truncate_state)

    def close(self) -> None:
        self.base.close()  # the base's tower owns the weights and every fine-tune's adapter

    def __enter__(self) -> Models[M]:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
