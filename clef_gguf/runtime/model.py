"""The pipeline: request -> validate -> encode -> tower -> lexical rows -> head -> answer.

``Clef.load`` opens the four files once; ``prepare`` (validate + tokenize, cheap) and ``run``
(the forward pass) are split so a server can refuse bad requests before queueing them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from clef_gguf.pipeline import answer
from clef_gguf.runtime import backends, engine, finetunes
from clef_gguf.core import errors
from clef_gguf.core.cpus import check_threads, set_torch_threads
from clef_gguf.formats import files as model_files
from clef_gguf.tower import cache as statecache
from clef_gguf.pipeline.encode import DEFAULT_MAX_LENGTH, TEMPLATE_SHA256, Encoded, Encoder, Prepared
from clef_gguf.formats import calibration as calibration_file
from clef_gguf.heads import head_scalars, load_head
from clef_gguf.models.catalog import is_catalog_name
from clef_gguf.pipeline.lexical import RowStore
from clef_gguf.media import support as media_support
from clef_gguf.media.sources import MediaPolicy
from clef_gguf.pipeline.request import parse_request
from clef_gguf.tower.protocol import LanguageTower, check_pack

log = logging.getLogger("clef_gguf")

# The head's dtype. "precision" is the audit's name for the tower's weight format (q4_k_m, f32...),
# so the head's is called head_dtype everywhere (``precision=`` stays accepted as its old spelling).
HEAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _named_model(request: Any) -> str | None:
    """The ``model`` a request body names, if it is a string (``parse_request`` checks the rest)."""
    name = request.get("model") if isinstance(request, dict) else None
    return name if isinstance(name, str) else None


def resolve(model: str | Path | None = None, *, gguf: str | Path | None = None,
            head: str | Path | None = None, head_config: str | Path | None = None,
            tokenizer: str | Path | None = None, allow_download: bool = False,
            context_tokens: int = DEFAULT_MAX_LENGTH,
            backend: str | None = None) -> model_files.ModelFiles:
    """A model directory, a .gguf beside its head files, explicit paths, or a catalog name."""
    explicit = {"tower": gguf, "head_weights": head, "head_config": head_config,
                "tokenizer": tokenizer}
    if model is None:
        if gguf is None or head is None or head_config is None or tokenizer is None:
            missing = [k for k, v in explicit.items() if v is None]
            raise errors.MissingField("give a model directory or all of --gguf, --head, "
                                      f"--head-config, --tokenizer (missing: {', '.join(missing)})",
                                      field="model")
        found = model_files.ModelFiles(Path(gguf), Path(head), Path(head_config), Path(tokenizer),
                                       name=Path(gguf).stem)
        found.check_exist()
        return found
    path = Path(model)
    if path.is_dir():
        found = model_files.from_directory(path, backend=backend)
    elif path.suffix == ".gguf":
        d = path.parent
        found = model_files.ModelFiles(path, d / model_files.HEAD_WEIGHTS,
                                       d / model_files.HEAD_CONFIG, d / model_files.TOKENIZER,
                                       name=path.stem)
    elif not path.exists() and is_catalog_name(str(model)):
        from clef_gguf.models import hub  # catalog names: clef-flash:Q4_K_M, clef-flash:auto

        found = hub.resolve(str(model), allow_download=allow_download, context_tokens=context_tokens)
    else:
        raise errors.ModelNotFound(
            f"model not found: {model} is neither a model directory or .gguf file, nor a catalog "
            "name (clef-flash, clef-flash:Q4_K_M, clef:auto, ...; see `clef-gguf list --available`)",
            field="model")
    # Explicit paths override what the directory or catalog named.
    for role, value in explicit.items():
        if value is not None:
            setattr(found, role, Path(value))
    found.check_exist()
    return found


class Clef:
    """A loaded Clef model: ``decide(request) -> SystemOne response dict``."""

    # Temperatures per question (``Clef.load(calibration=)``); None: the reference's T = 1.
    calibration: calibration_file.Calibration | None = None

    def __init__(self, files: model_files.ModelFiles, tower: LanguageTower, lexical: RowStore,
                 head: torch.nn.Module, encoder: Encoder, provenance: answer.Provenance,
                 info: dict[str, Any], *, strict: bool = False,
                 state_cache_mb: float = statecache.DEFAULT_MB,
                 state_cache: statecache.StateCache | None = None):
        self.files, self.tower, self.lexical, self.head = files, tower, lexical, head
        self.strict = strict  # refuse what the reference ignores, and apply Jev's count limits
        self.state_cache = (state_cache if state_cache is not None
                            else statecache.StateCache(int(state_cache_mb * (1 << 20))))
        self.encoder, self.provenance, self.info = encoder, provenance, info
        self.head_dtype = next(head.parameters()).dtype
        # The models this process answers with, by name: the base and its fine-tunes
        # (``finetunes.attach``), one dict shared by all of them; a request's ``model`` picks one.
        # Images and videos: the release's processor settings and vision tower (loaded on the first
        # picture), and where a request's pictures may come from (``prepare(media_policy=)``).
        self.media = media_support.MediaSupport.none()
        self.models: dict[str, Clef] = {provenance.model_name: self}
        self.default = provenance.model_name  # who answers a request that names no model
        self.base = self  # the model that owns the tower

    @classmethod
    def load(cls, model: str | Path | None = None, *, gguf: str | Path | None = None,
             head: str | Path | None = None, head_config: str | Path | None = None,
             tokenizer: str | Path | None = None, threads: int | None = None,
             max_length: int = DEFAULT_MAX_LENGTH, head_dtype: str = "fp32",
             allow_download: bool = False, strict: bool = False,
             state_cache_mb: float = statecache.DEFAULT_MB,
             gpu_layers: int | str = "auto", head_threads: int | None = None,
             backend: str | None = None,
             calibration: str | Path | calibration_file.Calibration | None = None,
             precision: str | None = None, adapters: finetunes.Adapters | None = None) -> Clef:
        """``backend``: ``gguf`` (llama.cpp) or ``nvfp4`` (a compressed-tensors checkpoint in
        PyTorch); None or ``auto``: what the model's files are. ``calibration``: a CAL.json
        written by ``clef-gguf calibrate`` for these very files (refused otherwise); None or
        "none": the reference's probabilities. ``head_dtype``: the head's fp32 (default) or bf16 (the
        reference's own numerics); ``precision`` is its earlier name. ``adapters``: fine-tunes
        (``clef-gguf convert adapter`` directories) on this tower: one directory (it answers every
        request) or ``{name: directory}`` (the base answers unless a request's ``model`` names one);
        the tower is loaded once whatever their number."""
        cal = calibration_file.load(calibration)  # a bad file fails before the tower loads
        if precision is not None and head_dtype != "fp32" and precision != head_dtype:
            raise errors.InvalidSetting(f"precision={precision!r} and head_dtype={head_dtype!r} disagree: "
                                        "precision is head_dtype's earlier name, give one", field="precision")
        asked = "head_dtype" if precision is None else "precision"
        head_dtype = head_dtype if precision is None else precision
        if head_dtype not in HEAD_DTYPES:
            raise errors.InvalidSetting(f"{asked} must be one of {', '.join(HEAD_DTYPES)}", field=asked)
        check_threads(head_threads, "head_threads")
        if not isinstance(state_cache_mb, (int, float)) or not 0 <= state_cache_mb < 1 << 30:
            raise errors.InvalidSetting(f"state_cache_mb must be a size in MiB >= 0 (got "
                                      f"{state_cache_mb!r})", field="state_cache_mb")
        found = resolve(model, gguf=gguf, head=head, head_config=head_config,
                        tokenizer=tokenizer, allow_download=allow_download,
                        context_tokens=max_length, backend=backend)
        opened = backends.open_tower_files(found, backend)
        lexical = opened.lexical
        joint = load_head(found.head_config, found.head_weights, hidden_size=lexical.hidden_size,
                          dtype=HEAD_DTYPES[head_dtype])
        encoder = Encoder.from_file(found.tokenizer, max_length)
        # The largest id as well as the count: a damaged tokenizer.json can hold ids past its size.
        ids = encoder.tokenizer.get_vocab(with_added_tokens=True).values()
        n_ids = max(encoder.vocab_size, max(ids, default=0) + 1)
        if n_ids > lexical.vocab_size:
            raise errors.HeadMismatch(
                f"the tokenizer has {n_ids} token ids but the {opened.label} vocab has only "
                f"{lexical.vocab_size}: they are not from the same release", field="tokenizer")
        tower = opened.load_tower(max_length, threads, gpu_layers)
        # The head runs after the tower on the same cores: torch gets as many threads as the
        # tower, not its default of every core (process-wide: torch has one intra-op pool).
        set_torch_threads(head_threads or tower.threads)
        if tower.n_embd != lexical.hidden_size:
            tower.close()
            raise errors.CorruptModel(f"n_embd {tower.n_embd} != lm_head width "
                                      f"{lexical.hidden_size}", field="tower")
        model_hash = opened.model_hash()  # the files that run, not the ones a manifest named
        quant = opened.quant
        provenance = answer.Provenance(found.name, model_hash, opened.runner, quant, TEMPLATE_SHA256,
                                       fine_tune=finetunes.merged_audit(found.fine_tune))
        info = {"name": found.name, "quant": quant, "revision": found.revision,
                "files": {p.name: found.known_sha256(p) for p in found.paths().values()}
                | {found.tower.name: model_hash},
                "backend": opened.runner, "precision": quant, "head_dtype": head_dtype,
                "max_length": max_length, "n_embd": tower.n_embd, "lexical_rows": lexical.type_name,
                "lm_head_avoided": tower.uses_nextn, "gpu_layers": tower.gpu_layers,
                "threads": tower.threads, "head_threads": torch.get_num_threads()}
        info |= tower.details()  # the backend's own facts (nvfp4: kernel, device)
        log.info("loaded %s (%s, n_embd %d) on %s, head scalars %s", found.tower.name, quant,
                 tower.n_embd, "the GPU" if tower.gpu_layers else "the CPU", head_scalars(joint))
        clef = cls(found, tower, lexical, joint, encoder, provenance, info, strict=strict,
                   state_cache_mb=state_cache_mb)
        clef.media = media_support.MediaSupport.of(found, opened.backend, threads=tower.threads)
        clef.info["vision"] = clef.media.describe()
        try:
            chosen = clef._attach(adapters)
            if cal is not None:
                cal.check_bound(chosen.calibration_binding())
                chosen.calibration = cal
                chosen.provenance = dataclasses.replace(chosen.provenance, calibration_version=cal.version)
        except BaseException:
            tower.close()
            raise
        return chosen

    def _attach(self, adapters: finetunes.Adapters | None) -> Clef:
        """Load ``adapters`` beside this base; the model that answers by default."""
        names, fine_default = finetunes.named(adapters)
        for name, found in names.items():
            if name in self.models:
                raise errors.InvalidSetting(f"the fine-tune name {name!r} is already the base's "
                                            "name: give it another", field="adapters")
            tune = finetunes.load(self.tower, self.provenance, self.lexical.hidden_size, self.head_dtype,
                                  name, found)
            model = type(self)(self.files, tune.tower, self.lexical, tune.head, self.encoder,
                               tune.provenance, self.info | tune.info, strict=self.strict,
                               state_cache=self.state_cache)
            model.models, model.base, model.media = self.models, self, self.media
            self.models[name] = model
        if fine_default:
            self.default = next(iter(names))
        for model in self.models.values():
            model.default = self.default
        return self.models[self.default]

    def calibration_binding(self) -> dict[str, str | None]:
        """What a calibration of this model must be bound to (its tower, head and adapter)."""
        found = self.base.files
        bound = calibration_file.binding(found, self.base.provenance.model_hash, TEMPLATE_SHA256)
        tune = self.provenance.fine_tune
        if tune is not None and "adapter_sha256" in tune:
            bound |= {"head_sha256": tune["head_sha256"], "head_config_sha256": tune["head_config_sha256"],
                      "adapter_sha256": tune["adapter_sha256"]}
        return bound

    def route(self, name: str | None) -> Clef:
        """The model a request's ``model`` names: None, the default; without fine-tunes any
        name is this model's (the name is only echoed, as the reference does)."""
        if name is None or len(self.models) == 1:
            return self.models[self.default]
        found = self.models.get(name)
        if found is None:
            raise errors.UnknownModel(f"no model named {name!r} here; this process serves "
                                      f"{', '.join(sorted(self.models))}", field="model")
        return found

    def prepare(self, request: Any, *, truncate_state: bool = False,
                strict: bool | None = None, media_policy: MediaPolicy | None = None) -> Prepared:
        """Validate and tokenize ``request`` (and read and process its images and videos, from the
        sources ``media_policy`` allows: None, any path or URL, as the reference reads them)."""
        t0 = time.perf_counter()
        # The request's model is read before it is checked: which model answers decides whether
        # a calibration applies (the wire model is the same for every one of them).
        target = self.route(_named_model(request))
        parsed = parse_request(request, truncate_state=truncate_state,
                               strict=target.strict if strict is None else strict,
                               calibrated=target.calibration is not None)
        if target.calibration is not None:
            target.calibration.check_requested(parsed.calibration)
        if parsed.has_media:
            media = target.media.tokens(parsed, target.encoder, media_policy)
            parsed = dataclasses.replace(parsed, warnings=parsed.warnings + media_support.warnings(media))
            encoded = media.attach(target.encoder.encode(parsed, media.ids))
        else:
            encoded = target.encoder.encode(parsed)
        return Prepared(parsed, encoded, (time.perf_counter() - t0) * 1e3, target.provenance.model_name)

    def _tower(self, enc: Encoded) -> tuple[np.ndarray, int, float]:
        """(hidden states, cached tokens, tower ms) of one prompt."""
        t0 = time.perf_counter()
        hidden, cached = self.tower.forward(enc.ids, enc.prefix_tokens, enc.state_tokens,
                                            self.state_cache, enc.media)
        return hidden, cached, (time.perf_counter() - t0) * 1e3

    def logits(self, enc: Encoded) -> np.ndarray:
        """Flat fp32 head logits of a prepared prompt, every option of every question."""
        hidden, _, _ = self._tower(enc)
        return self._head_logits(enc, hidden)[0]

    def answering(self, prepared: Prepared) -> Clef:
        """The model ``prepared`` was prepared for."""
        return self.models.get(prepared.model, self) if prepared.model else self

    def run(self, prepared: Prepared) -> tuple[dict, dict[str, float]]:
        model = self.answering(prepared)
        return model._answer(prepared, *model._tower(prepared.encoded))

    def decide(self, request: Any, *, truncate_state: bool = False,
               strict: bool | None = None) -> dict:
        return self.run(self.prepare(request, truncate_state=truncate_state, strict=strict))[0]

    def decide_many(self, requests: Iterable[Any], *, truncate_state: bool = False,
                    window: int = engine.WINDOW, pack: int | None = None) -> Iterator[dict]:
        """One response per request, in input order, as a generator; a request that fails gives
        ``{"error": {code, message, field}}`` in its place instead of stopping the rest.

        Within each ``window`` of requests, those about the same state run one after another, so
        its ``[prefix][state]`` is decoded once and restored for the others (the state cache).
        ``pack``: prompts the tower decodes together per llama_decode (see :meth:`run_many`)."""
        if not isinstance(window, int) or window < 1:
            raise errors.InvalidValue(f"window must be a whole number >= 1 (got {window!r})",
                                      field="window")
        check_pack(pack)
        for chunk in engine.windows(requests, window):
            yield from engine.answer(self, chunk, truncate_state=truncate_state, pack=pack)

    def pack_size(self, prepared: Prepared) -> int:
        """How many prompts like this one the tower decodes together (1: one at a time)."""
        if prepared.encoded.media is not None:
            return 1
        return self.answering(prepared).tower.pack_size(prepared.encoded.n_tokens)

    def run_many(self, prepared: list[Prepared], *, pack: int | None = None
                 ) -> list[tuple[dict, dict[str, float]] | errors.ClefError]:
        """``run`` for several prepared requests, in order: ``(response, timings)`` each, or the
        ClefError it raised (the others still run). The tower decodes up to ``pack`` prompts per
        llama_decode (None: its policy, ``packing.PACKING``; 1: one at a time, exactly ``run``); the
        answers are the same either way. A packed request's ``tower`` time is its share of the
        packed decode."""
        check_pack(pack)
        Result = tuple[dict, dict[str, float]] | errors.ClefError  # noqa: N806
        out: list[Result | None] = [None] * len(prepared)
        # One decode applies one adapter, and a media prompt decodes alone (its embeddings and
        # positions are its own): each model's text prompts together, the others one at a time.
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prepared):
            if pack == 1 or p.encoded.media is not None:
                out[i] = self._run_or_error(p)
            else:
                groups.setdefault(self.answering(p).provenance.model_name, []).append(i)
        for name, where in groups.items():
            for i, result in zip(where, self.models[name]._run_packed([prepared[i] for i in where], pack)):
                out[i] = result
        return [r for r in out if r is not None]

    def _run_packed(self, prepared: list[Prepared], pack: int | None
                    ) -> list[tuple[dict, dict[str, float]] | errors.ClefError]:
        """``run_many`` of text prompts all for this model: decoded together where the tower packs."""
        if len(prepared) < 2:
            return [self._run_or_error(p) for p in prepared]
        t0 = time.perf_counter()
        towers = self.tower.forward_many([(p.encoded.ids, p.encoded.prefix_tokens, p.encoded.state_tokens)
                                          for p in prepared], self.state_cache, pack=pack)
        share = (time.perf_counter() - t0) * 1e3 / len(prepared)
        results: list[tuple[dict, dict[str, float]] | errors.ClefError] = []
        for p, tower in zip(prepared, towers):
            if isinstance(tower, errors.ClefError):
                results.append(tower)
                continue
            try:
                results.append(self._answer(p, *tower, share))
            except errors.ClefError as exc:
                results.append(exc)
        return results

    def _run_or_error(self, prepared: Prepared) -> tuple[dict, dict[str, float]] | errors.ClefError:
        try:
            return self.run(prepared)
        except errors.ClefError as exc:
            return exc

    def _head_logits(self, enc: Encoded, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """(flat fp32 logits, option token ids, perf_counter after the lexical rows) of ``hidden``."""
        option_ids = enc.option_token_ids()
        rows = self.lexical.rows(option_ids)
        t = time.perf_counter()
        with torch.inference_mode():
            logits = self.head(torch.from_numpy(hidden), torch.from_numpy(rows).to(self.head_dtype),
                               list(enc.question_spans), list(enc.option_spans),
                               list(enc.option_counts), list(enc.types))
        return logits.float().numpy(), option_ids, t

    def _answer(self, prepared: Prepared, hidden: np.ndarray, cached: int,
                tower_ms: float) -> tuple[dict, dict[str, float]]:
        """What ``run`` does after the tower (lexical rows, head, answer), on given hidden states."""
        enc = prepared.encoded
        t1 = time.perf_counter()
        logits, option_ids, t2 = self._head_logits(enc, hidden)
        t3 = time.perf_counter()
        probs = answer.split_probabilities(logits, enc.option_counts, self.temperatures(enc))
        response = answer.envelope(prepared.request, probs, enc.n_tokens, self.provenance,
                                   truncated=enc.truncated, option_token_ids=option_ids,
                                   cached_tokens=cached)
        t4 = time.perf_counter()
        ms = lambda a, b: round((b - a) * 1e3, 3)  # noqa: E731
        timings = {"encode": round(prepared.encode_ms, 3), "tower": round(tower_ms, 3),
                   "lexical": ms(t1, t2), "head": ms(t2, t3), "answer": ms(t3, t4),
                   "total": round(prepared.encode_ms + tower_ms + (t4 - t1) * 1e3, 3),
                   "tokens": enc.n_tokens}
        return response, timings

    def probabilities(self, request: Any, *, truncate_state: bool = False) -> list[np.ndarray]:
        """Unrounded fp32 probabilities per question, in prompt option order (parity checks)."""
        prepared = self.prepare(request, truncate_state=truncate_state)
        model, enc = self.answering(prepared), prepared.encoded
        return answer.split_probabilities(model.logits(enc), enc.option_counts, model.temperatures(enc))

    def temperatures(self, enc: Encoded) -> tuple[float, ...] | None:
        """The calibration's temperature of each question of ``enc`` (None: uncalibrated)."""
        if self.calibration is None:
            return None
        return self.calibration.temperatures_for(enc.types, enc.option_counts)

    def close(self) -> None:
        self.base.tower.close()  # the base's tower owns the weights and every fine-tune's adapter

    def __enter__(self) -> Clef:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
