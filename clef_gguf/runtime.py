"""The pipeline: request -> validate -> encode -> tower -> lexical rows -> head -> answer.

``Clef.load`` opens the four files once; ``prepare`` (validate + tokenize, cheap) and ``run``
(the forward pass) are split so a server can refuse bad requests before queueing them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clef_gguf import answer, errors, files as model_files
from clef_gguf.encode import DEFAULT_MAX_LENGTH, TEMPLATE_SHA256, Encoded, Encoder
from clef_gguf.heads import head_scalars, load_head
from clef_gguf.models.catalog import is_catalog_name
from clef_gguf.lexical import LexicalRows, field_value, file_type_name, open_gguf
from clef_gguf.request import Request, parse_request
from clef_gguf.tower import Tower

log = logging.getLogger("clef_gguf")

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOWER_ARCH = "qwen35"
BACKEND = "llama-cpp-python"


@dataclass(frozen=True)
class Prepared:
    request: Request
    encoded: Encoded
    encode_ms: float


def resolve(model: str | Path | None = None, *, gguf: str | Path | None = None,
            head: str | Path | None = None, head_config: str | Path | None = None,
            tokenizer: str | Path | None = None, allow_download: bool = False,
            context_tokens: int = DEFAULT_MAX_LENGTH) -> model_files.ModelFiles:
    """A model directory, a .gguf beside its head files, explicit paths, or a catalog name."""
    explicit = {"tower": gguf, "head_weights": head, "head_config": head_config,
                "tokenizer": tokenizer}
    if model is None:
        missing = [k for k, v in explicit.items() if v is None]
        if missing:
            raise errors.MissingField("give a model directory or all of --gguf, --head, "
                                      f"--head-config, --tokenizer (missing: {', '.join(missing)})",
                                      field="model")
        found = model_files.ModelFiles(**{k: Path(v) for k, v in explicit.items()},
                                       name=Path(gguf).stem)
        found.check_exist()
        return found
    path = Path(model)
    if path.is_dir():
        found = model_files.from_directory(path)
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

    def __init__(self, files: model_files.ModelFiles, tower: Tower, lexical: LexicalRows,
                 head: torch.nn.Module, encoder: Encoder, provenance: answer.Provenance,
                 info: dict[str, Any], *, strict: bool = False):
        self.files, self.tower, self.lexical, self.head = files, tower, lexical, head
        self.strict = strict  # refuse what the reference ignores, and apply Jev's count limits
        self.encoder, self.provenance, self.info = encoder, provenance, info
        self.head_dtype = next(head.parameters()).dtype

    @classmethod
    def load(cls, model: str | Path | None = None, *, gguf: str | Path | None = None,
             head: str | Path | None = None, head_config: str | Path | None = None,
             tokenizer: str | Path | None = None, threads: int | None = None,
             max_length: int = DEFAULT_MAX_LENGTH, precision: str = "fp32",
             allow_download: bool = False, strict: bool = False) -> Clef:
        if precision not in PRECISIONS:
            raise errors.InvalidValue(f"precision must be one of {', '.join(PRECISIONS)}",
                                      field="precision")
        found = resolve(model, gguf=gguf, head=head, head_config=head_config,
                        tokenizer=tokenizer, allow_download=allow_download,
                        context_tokens=max_length)
        # gguf-py validates the whole file table first: llama.cpp aborts on some corrupt files.
        reader = open_gguf(found.tower)
        arch = field_value(reader, "general.architecture")
        if arch != TOWER_ARCH:
            raise errors.CorruptModel(
                f"{found.tower.name} has architecture {arch!r}; clef-gguf runs {TOWER_ARCH!r} towers"
                + (" (convert a native clef GGUF with `clef-gguf convert split`)" if arch == "clef"
                   else ""), field="tower")
        lexical = LexicalRows(reader)
        joint = load_head(found.head_config, found.head_weights, hidden_size=lexical.hidden_size,
                          dtype=PRECISIONS[precision])
        encoder = Encoder.from_file(found.tokenizer, max_length)
        if encoder.vocab_size > lexical.vocab_size:
            raise errors.HeadMismatch(
                f"the tokenizer has {encoder.vocab_size} tokens but the GGUF vocab has only "
                f"{lexical.vocab_size}: they are not from the same release", field="tokenizer")
        tower = Tower.load(found.tower, n_ctx=max_length, threads=threads)
        if tower.n_embd != lexical.hidden_size:
            tower.close()
            raise errors.CorruptModel(f"n_embd {tower.n_embd} != lm_head width "
                                      f"{lexical.hidden_size}", field="tower")
        model_hash = found.sha256_of(found.tower)  # the file that runs, not the one a manifest named
        quant = file_type_name(reader)
        provenance = answer.Provenance(found.name, model_hash, BACKEND, quant, TEMPLATE_SHA256)
        info = {"name": found.name, "quant": quant, "revision": found.revision,
                "files": {p.name: found.known_sha256(p) for p in found.paths().values()}
                | {found.tower.name: model_hash},
                "backend": BACKEND, "precision": quant, "head_dtype": precision,
                "max_length": max_length, "n_embd": tower.n_embd, "lexical_rows": lexical.type.name,
                "lm_head_avoided": tower.uses_nextn}
        log.info("loaded %s (%s, n_embd %d), head scalars %s", found.tower.name, quant,
                 tower.n_embd, head_scalars(joint))
        return cls(found, tower, lexical, joint, encoder, provenance, info, strict=strict)

    def prepare(self, request: Any, *, truncate_state: bool = False,
                strict: bool | None = None) -> Prepared:
        t0 = time.perf_counter()
        parsed = parse_request(request, truncate_state=truncate_state,
                               strict=self.strict if strict is None else strict)
        encoded = self.encoder.encode(parsed)
        return Prepared(parsed, encoded, (time.perf_counter() - t0) * 1e3)

    def _forward(self, enc: Encoded) -> tuple[np.ndarray, np.ndarray, tuple[float, ...]]:
        """Flat fp32 logits, the option token ids, and perf_counter marks between stages."""
        t0 = time.perf_counter()
        hidden = self.tower.hidden_states(enc.ids)
        t1 = time.perf_counter()
        option_ids = enc.option_token_ids()
        rows = self.lexical.rows(option_ids)
        t2 = time.perf_counter()
        with torch.inference_mode():
            logits = self.head(torch.from_numpy(hidden), torch.from_numpy(rows).to(self.head_dtype),
                               list(enc.question_spans), list(enc.option_spans),
                               list(enc.option_counts), list(enc.types))
        return logits.float().numpy(), option_ids, (t0, t1, t2, time.perf_counter())

    def run(self, prepared: Prepared) -> tuple[dict, dict[str, float]]:
        enc = prepared.encoded
        logits, option_ids, (t0, t1, t2, t3) = self._forward(enc)
        probs = answer.split_probabilities(logits, enc.option_counts)
        response = answer.envelope(prepared.request, probs, enc.n_tokens, self.provenance,
                                   truncated=enc.truncated, option_token_ids=option_ids)
        t4 = time.perf_counter()
        ms = lambda a, b: round((b - a) * 1e3, 3)  # noqa: E731
        timings = {"encode": round(prepared.encode_ms, 3), "tower": ms(t0, t1),
                   "lexical": ms(t1, t2), "head": ms(t2, t3), "answer": ms(t3, t4),
                   "total": round(prepared.encode_ms + (t4 - t0) * 1e3, 3), "tokens": enc.n_tokens}
        return response, timings

    def decide(self, request: Any, *, truncate_state: bool = False,
               strict: bool | None = None) -> dict:
        return self.run(self.prepare(request, truncate_state=truncate_state, strict=strict))[0]

    def probabilities(self, request: Any, *, truncate_state: bool = False) -> list[np.ndarray]:
        """Unrounded fp32 probabilities per question, in prompt option order (parity checks)."""
        enc = self.prepare(request, truncate_state=truncate_state).encoded
        return answer.split_probabilities(self._forward(enc)[0], enc.option_counts)

    def close(self) -> None:
        self.tower.close()

    def __enter__(self) -> Clef:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
