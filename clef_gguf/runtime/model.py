"""One model: request -> validate -> encode -> tower -> lexical rows -> head -> answer.

``prepare`` (validate + tokenize, cheap) and ``run`` (the forward pass) are split so a server can
refuse bad requests before queueing them. A ``Clef`` never routes: the set of models a process serves,
and which one a request's ``model`` picks, is ``registry.Models``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch

from clef_gguf.core import errors
from clef_gguf.formats.calibration import IDENTITY, Calibration, binding
from clef_gguf.formats.files import ModelFiles
from clef_gguf.media.sources import MediaPolicy
from clef_gguf.media.support import MediaSupport, warnings as media_warnings
from clef_gguf.pipeline import answer
from clef_gguf.pipeline.encode import TEMPLATE_SHA256, Encoded, Encoder, Prepared
from clef_gguf.pipeline.evidence import with_evidence
from clef_gguf.pipeline.lexical import RowStore
from clef_gguf.pipeline.request import parse_request
from clef_gguf.runtime import engine, evidence, load as loader, stages
from clef_gguf.runtime.registry import Models
from clef_gguf.runtime.settings import Adapters, LoadSettings
from clef_gguf.tower.cache import StateCache
from clef_gguf.tower.protocol import LanguageTower, check_pack


@dataclass(eq=False)
class Clef:
    """A loaded Clef model: ``decide(request) -> SystemOne response dict``."""

    files: ModelFiles
    tower: LanguageTower  # a fine-tune's is a view of its base's, applying its adapter
    lexical: RowStore
    head: torch.nn.Module
    encoder: Encoder
    provenance: answer.Provenance
    info: dict[str, Any]
    strict: bool = False  # refuse what the reference ignores, and apply Jev's count limits
    state_cache: StateCache = field(default_factory=StateCache)
    media: MediaSupport = field(default_factory=MediaSupport.none)  # processor, vision tower (lazy)
    settings: LoadSettings = field(default_factory=lambda: LoadSettings())  # what it was loaded with
    calibration: Calibration = IDENTITY  # temperatures per question, applied by the answer stage
    base: Clef | None = None  # a fine-tune's base (None: this is the base, it owns the tower)

    @overload
    @classmethod
    def load(cls, model: str | Path | None = None, *, adapters: None = None, precision: str | None = None,
             **settings: Any) -> Clef: ...

    @overload
    @classmethod
    def load(cls, model: str | Path | None = None, *, adapters: Adapters, precision: str | None = None,
             **settings: Any) -> Models[Clef]: ...

    @classmethod
    def load(cls, model: str | Path | None = None, *, adapters: Adapters | None = None,
             precision: str | None = None, **settings: Any) -> Clef | Models[Clef]:
        """Load a model: its files checked against each other, then its tower, head and tokenizer.

        Args:
            model: a converted model directory, a ``.gguf`` beside its head files, or a catalog name
                (``"clef-flash:Q4_K_M"``, ``"clef-flash:auto"``: pulled on first use). None: the
                files given one by one (``gguf=``, ``head=``, ``head_config=``, ``tokenizer=``).
            adapters: fine-tunes to serve on the same tower: one fine-tune directory, or a
                ``{name: directory}`` mapping; their number adds no tower.
            precision: ``head_dtype``'s earlier name; give one of the two.
            **settings: any other ``LoadSettings`` field (``threads``, ``max_length``, ``gpu_layers``,
                ``head_dtype``, ``calibration``, ``backend``, ``state_cache_mb``, ``strict``...).

        Returns:
            Without ``adapters``, the ``Clef``. With them, the ``Models`` of the base and its
            fine-tunes: its ``decide`` routes by a request's ``model``, and ``models[name]`` is one
            ``Clef`` that answers as itself.

        Raises:
            InvalidSetting: an unknown keyword, a value out of range, or a setting these files cannot
                take (``backend="nvfp4"`` for a GGUF, a llama.cpp setting for an NVFP4 checkpoint...).
            ModelNotFound: no model directory, file or catalog name ``model`` names.
            CorruptModel: a file that cannot be read as what it should be.
            HeadMismatch: head files that do not fit the tower (another width, vocabulary, release).
            AdapterMismatch: a fine-tune made on another base, size or architecture.
            PinMismatch: the Hub no longer serves what a catalog source's first pull pinned.
            NoQuantFits: ``:auto`` where no quant of the family fits this machine.
            CalibrationMismatch: a ``calibration`` file fitted on other weights, template or head.
            CorruptCalibration: a ``calibration`` file that cannot be read.
            MissingDependency: the nvfp4 backend without its extra (``pip install 'clef-gguf[nvfp4]'``).

        Every one is a ``ClefError``; the file errors derive from ``ModelLoadError``.
        """
        models = cls.from_settings(LoadSettings.of(model=model, adapters=adapters, precision=precision, **settings))
        return models if adapters is not None else models.default_model

    @classmethod
    def from_settings(cls, settings: LoadSettings) -> Models[Clef]:
        """Every model ``settings`` name (the commands' and the Ray workers' way in)."""
        return loader.load(settings, cls)

    @property
    def name(self) -> str:
        return self.provenance.model_name

    @property
    def models(self) -> dict[str, Clef]:
        return {self.name: self}  # one model; ``Models`` holds several

    @property
    def head_dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype

    @property
    def head_device(self) -> torch.device:
        return next(self.head.parameters()).device

    def calibrated(self, calibration: Calibration) -> Clef:
        provenance = dataclasses.replace(self.provenance, calibration_version=calibration.version)
        return dataclasses.replace(self, calibration=calibration, provenance=provenance,
                                   info=self.info | {"calibration_version": calibration.version})

    def calibration_binding(self) -> dict[str, str | None]:
        """What a calibration of this model must be bound to (its tower, head and adapter)."""
        base = self.base or self
        bound = binding(base.files, base.provenance.model_hash, TEMPLATE_SHA256)
        tune = self.provenance.fine_tune
        if tune is not None and "adapter_sha256" in tune:
            bound |= {k: tune[k] for k in ("head_sha256", "head_config_sha256", "adapter_sha256")}
        return bound

    # ------------------------------------------------------------ one request
    def prepare(self, request: Any, *, truncate_state: bool = False, strict: bool | None = None,
                media_policy: MediaPolicy | None = None) -> Prepared:
        """Validate and tokenize a request, without running the model: cheap, so a server refuses bad
        requests before queueing them.

        Args:
            request: a SystemOne request, as a decoded JSON object (a dict).
            truncate_state: cut the state to fit ``max_length`` instead of refusing the request.
            strict: refuse what the reference ignores (unknown keys...); None: as the model was loaded.
            media_policy: where its images and videos may be read from; None: any path or URL, as the
                reference reads them.

        Returns:
            The ``Prepared`` request (its token ids and spans, its pictures processed), for :meth:`run`.

        Raises:
            InvalidRequest: the request is not a valid one, as one of its subclasses naming the field:
                ``InvalidJson``, ``MissingField``, ``UnknownField`` (strict), ``InvalidValue``,
                ``InvalidQuestionType``, ``NoQuestions``, ``TooManyQuestions``, ``EmptyQuestionId``,
                ``InvalidCriteria``, ``TooFewOptions``, ``TooManyOptions``, ``Unsupported``,
                ``WrongCalibration``, ``UnsupportedMediaSource``, ``InvalidMedia``.
            ContextTooLarge: the prompt is longer than ``max_length``: its state without
                ``truncate_state``, or its questions and pictures alone.
            MediaTooLarge: a picture or video over its byte or pixel budget.
        """
        t0 = time.perf_counter()
        parsed = parse_request(request, truncate_state=truncate_state,
                               strict=self.strict if strict is None else strict,
                               calibrated=not self.calibration.is_identity)
        self.calibration.check_requested(parsed.calibration)
        if parsed.has_media:
            media = self.media.tokens(parsed, self.encoder, media_policy)
            parsed = dataclasses.replace(parsed, warnings=parsed.warnings + media_warnings(media))
            encoded = media.attach(self.encoder.encode(parsed, media.ids))
        else:
            encoded = self.encoder.encode(parsed)
        return Prepared(parsed, encoded, (time.perf_counter() - t0) * 1e3, self.name)

    def run(self, prepared: Prepared) -> answer.Decision:
        """Run the model on a prepared request: tower, lexical rows, head, answer.

        Args:
            prepared: what :meth:`prepare` returned.

        Returns:
            The ``Decision``: its ``response`` (the SystemOne response dict) and the milliseconds of each
            stage.

        Raises:
            InferenceError: the tower failed on this prompt (llama.cpp, or the nvfp4 backend).
        """
        enc, t0 = prepared.encoded, time.perf_counter()
        hidden, cached = self.tower.forward(enc.ids, enc.prefix_tokens, enc.state_tokens, self.state_cache,
                                            enc.media)
        return self._answer(prepared, hidden, cached, (time.perf_counter() - t0) * 1e3)

    def decide(self, request: Any, *, truncate_state: bool = False, strict: bool | None = None,
               evidence: bool | dict[str, Any] | None = None) -> dict:
        """Answer one request: :meth:`run` of :meth:`prepare`.

        Args:
            request: a SystemOne request, as a decoded JSON object (a dict).
            truncate_state: as :meth:`prepare`'s.
            strict: as :meth:`prepare`'s.
            evidence: the request's ``"evidence"`` key set from Python (docs/evidence.md): True, a
                dict of its options, or False (none); None leaves the request's own key.

        Returns:
            The SystemOne response dict (``answers``, ``audit``, and ``warnings``/``evidence`` when
            there are any).

        Raises:
            InvalidRequest, ContextTooLarge, MediaTooLarge: as :meth:`prepare`.
            InferenceError: as :meth:`run`.
        """
        request = with_evidence(request, evidence)
        return self.run(self.prepare(request, truncate_state=truncate_state, strict=strict)).response

    def logits(self, enc: Encoded) -> np.ndarray:
        """Flat fp32 head logits of a prepared prompt, every option of every question."""
        hidden, _ = self.tower.forward(enc.ids, enc.prefix_tokens, enc.state_tokens, self.state_cache, enc.media)
        return stages.head_logits(self.head, self.lexical, enc, hidden)[0]

    def probabilities(self, request: Any, *, truncate_state: bool = False) -> list[np.ndarray]:
        """Unrounded fp32 probabilities per question, in prompt option order (parity checks)."""
        enc = self.prepare(request, truncate_state=truncate_state).encoded
        return answer.split_probabilities(self.logits(enc), enc.option_counts, self.temperatures(enc))

    def flat_probabilities(self, enc: Encoded, hidden: np.ndarray) -> np.ndarray:
        """Unrounded fp32 probabilities of every option, in one flat array (``probabilities`` gives one per
        question), from hidden states of ``enc`` computed elsewhere (checks of one tower route against
        another: packed, a reference model)."""
        logits = stages.head_logits(self.head, self.lexical, enc, hidden)[0]
        return np.concatenate(answer.split_probabilities(logits, enc.option_counts, self.temperatures(enc)))

    def temperatures(self, enc: Encoded) -> tuple[float, ...]:
        """The calibration's temperature of each question of ``enc`` (all 1: uncalibrated)."""
        return self.calibration.temperatures_for(enc.types, enc.option_counts)

    # ------------------------------------------------------------ many requests
    def decide_many(self, requests: Iterable[Any], *, truncate_state: bool = False,
                    window: int = engine.WINDOW, pack: int | None = None) -> Iterator[dict]:
        """Answer many requests, read lazily; requests about one state run one after another, so its
        ``[prefix][state]`` is decoded once.

        Args:
            requests: SystemOne requests (any iterable; read ``window`` at a time).
            truncate_state: as :meth:`prepare`'s, for every request.
            window: how many requests are read and ordered together.
            pack: prompts per llama_decode (None: the tower's policy; 1: one at a time), as
                :meth:`run_many`.

        Returns:
            A generator of one response dict per request, in input order. A request that fails gives
            ``{"error": {"code", "message", "field"}}`` in its place, and the others are answered.

        Raises:
            InvalidValue: ``window`` or ``pack`` is not a whole number >= 1 (when the generator starts).
            No request's own error is raised: each is its response.
        """
        return engine.decide_many(self, requests, truncate_state=truncate_state, window=window, pack=pack)

    def pack_size(self, prepared: Prepared) -> int:
        """How many prompts like this one the tower decodes together (1: one at a time)."""
        return 1 if prepared.encoded.media is not None else self.tower.pack_size(prepared.encoded.n_tokens)

    def run_many(self, prepared: list[Prepared], *, pack: int | None = None) -> list[engine.Outcome]:
        """``run`` for each, in order: its Decision or the ClefError it raised (the others still run).
        Text prompts share llama_decodes up to ``pack`` (None: the tower's policy, 1: one at a time),
        with the same answers; a media prompt decodes alone. A packed request's ``tower`` time is its
        share of the packed decode."""
        check_pack(pack)
        text = [i for i, p in enumerate(prepared) if pack != 1 and p.encoded.media is None]
        out: dict[int, engine.Outcome] = {}
        if len(text) > 1:
            t0 = time.perf_counter()
            towers = self.tower.forward_many([(prepared[i].encoded.ids, prepared[i].encoded.prefix_tokens,
                                               prepared[i].encoded.state_tokens) for i in text],
                                             self.state_cache, pack=pack)
            share = (time.perf_counter() - t0) * 1e3 / len(text)
            for i, tower in zip(text, towers):
                out[i] = tower if isinstance(tower, errors.ClefError) else \
                    engine.attempt(self._answer, prepared[i], *tower, share)
        return [out[i] if i in out else engine.attempt(self.run, p) for i, p in enumerate(prepared)]

    def _answer(self, prepared: Prepared, hidden: np.ndarray, cached: int, tower_ms: float) -> answer.Decision:
        explain = None if prepared.request.evidence is None else functools.partial(evidence.explain, self, prepared)
        return stages.decision(prepared, hidden, cached, tower_ms, head=self.head, lexical=self.lexical,
                               provenance=self.provenance, temperatures=self.temperatures(prepared.encoded),
                               explain=explain)

    def close(self) -> None:
        self.tower.close()  # a fine-tune's view closes nothing: the base's tower owns the weights

    def __enter__(self) -> Clef:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
