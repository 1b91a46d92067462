"""The model catalog: typed view of ``catalog.json`` and model names like ``clef-flash:Q4_K_M``.

The facts (repositories, pinned revisions, file names, sizes, hashes, memory constants) live in
``catalog.json`` next to this module so they can be reviewed and updated without touching code.
A ``null`` there means "not confirmed", and the code treats it that way: no size is invented (an
estimate is labelled as one), no hash is assumed, an unpinned source is reported as unpinned.

Names: ``FAMILY[:QUANT][@SOURCE]``. ``clef-flash`` alone means ``clef-flash:auto`` (pick by device);
``@SOURCE`` (an alias such as ``bartowski``) forces one repository instead of the preference order.
QUANT is a GGUF quant type (``Q4_K_M``) or, for the nvfp4 backend, the scheme of a compressed-tensors
checkpoint (``NVFP4A16`` weights-only, ``NVFP4`` W4A4): ``clef-flash:nvfp4a16``, ``clef-flash:nvfp4``,
``clef:nvfp4``. Such a checkpoint is a whole repository directory, not one file, and ``auto`` never
picks one (the backend is opt-in by name); ``clef-flash@nvfp4`` (a checkpoint source, no quant) means
its one scheme.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from clef_gguf.core.errors import ModelNotFound
from clef_gguf.core.limits import GB

CATALOG_FORMAT = "clef-gguf-catalog/1"
CATALOG_PATH = Path(__file__).with_name("catalog.json")
# Lets a test (or a user with a private mirror) swap the whole catalog without editing package data.
CATALOG_ENV = "CLEF_GGUF_CATALOG"
AUTO = "auto"
GGUF_SUFFIX = "-GGUF"  # clef-flash:nvfp4a16-gguf: a checkpoint re-encoded as an NVFP4 GGUF (nvfp4_materialize.py)
ROLES = ("tower", "head", "native", "nvfp4")
HEAD_KEYS = ("head_weights", "head_config", "tokenizer")


@dataclass(frozen=True)
class FileEntry:
    """One file of a source: ``key`` is a quant type (tower/native) or a head role."""

    key: str
    file: str | None
    size: int | None = None
    size_gb: float | None = None
    sha256: str | None = None

    def known_size(self) -> tuple[int, str] | None:
        """(bytes, basis): exact bytes first, else the card's GB figure; None if neither is known."""
        if self.size is not None:
            return self.size, "exact"
        if self.size_gb is not None:
            return int(round(self.size_gb * GB)), "card"
        return None


@dataclass(frozen=True)
class Checkpoint:
    """A safetensors checkpoint directory (role nvfp4): the :QUANT naming it, what a pull downloads,
    and the memory figures ``pick`` budgets with (catalog.json says where each comes from)."""

    quant: str  # NVFP4A16, NVFP4
    scheme: str  # W4A16, W4A4
    allow_patterns: tuple[str, ...]
    required: tuple[str, ...]
    weights: str  # fnmatch pattern of the weight files
    index: str  # the sharded checkpoint's index file name
    quantized_weights_bytes: int  # packed FP4 layers as they sit in device memory
    bf16_weights_bytes: int  # tensors kept in bf16 on the device (embed_tokens), on top of the packed ones
    dequant_scratch_bytes: int  # the one dense layer the dequantizing fallback holds at a time
    size_gb: float | None = None  # the repository on disk, as printed (or proxied, see size_basis)
    size_basis: str | None = None

    def known_size(self) -> tuple[int, str] | None:
        """(bytes, basis) of the download, or None if no figure is known."""
        if self.size_gb is None:
            return None
        return int(round(self.size_gb * GB)), self.size_basis or "card"


@dataclass(frozen=True)
class Source:
    id: str
    family: str
    alias: str
    role: str
    repo: str
    revision: str | None
    files: dict[str, FileEntry]
    # For repos whose file names are not confirmed: fnmatch pattern with {quant}, resolved from the
    # repository listing at pull time rather than guessed here.
    file_pattern: str | None = None
    evidence: str = ""
    checkpoint: Checkpoint | None = None  # role nvfp4 only

    @property
    def backend(self) -> str:
        return "nvfp4" if self.role == "nvfp4" else "gguf"

    @property
    def pinned(self) -> bool:
        return self.revision is not None

    @property
    def quants(self) -> tuple[str, ...]:
        if self.checkpoint is not None:  # the checkpoint, and its re-encoding as an NVFP4 GGUF
            return (self.checkpoint.quant, self.checkpoint.quant + GGUF_SUFFIX)
        return tuple(self.files) if self.role in ("tower", "native") else ()

    def entry(self, key: str) -> FileEntry:
        try:
            return self.files[key]
        except KeyError:
            raise ModelNotFound(f"{self.repo} has no {key} in the catalog; it lists: "
                                f"{', '.join(self.files) or 'nothing'}", field="model") from None

    def pattern_for(self, quant: str) -> str | None:
        return self.file_pattern.replace("{quant}", quant) if self.file_pattern else None


@dataclass(frozen=True)
class Architecture:
    hidden_size: int
    layers: int
    recurrent_layers: int
    attention_layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    # The rest of the shape, where the catalog gives it: what ``convert.synthetic.shapes`` builds a random
    # model of this family's shape from (its ``head``: the joint head's width, layers, heads, feed-forward).
    feed_forward: int | None = None
    full_attention_interval: int | None = None
    linear_key_heads: int | None = None
    linear_value_heads: int | None = None
    linear_head_dim: int | None = None
    rope_theta: float | None = None
    mrope_sections: list[int] | None = None
    head: dict[str, int] | None = None


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a decision takes besides the tower file, part by part (catalog.json says where each comes
    from: measured at the family's shape by benchmarks/memory.py, or derived from its dimensions)."""

    kv_bytes_per_token: int  # llama.cpp's KV cache, allocated for the whole context at load
    recurrent_bytes_per_sequence: int
    head_bytes: int  # the joint head's weights as they run (fp32: twice the bf16 file)
    compute_bytes: int  # llama.cpp's compute and output buffers at its 512-token ubatch
    runtime_bytes: int  # Python, torch, both tokenizers, the lexical rows, allocator slack
    activation_bytes_per_token: int  # per prompt token: hidden states and the head's activations
    vision_bytes: int = 0  # the vision tower's weights and a picture's activations, once a request has one


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    architecture: Architecture
    memory: MemoryModel
    size_overhead_bytes: int
    size_bytes_per_bpw: int
    head_source: Source
    tower_sources: tuple[Source, ...]
    other_sources: tuple[Source, ...]
    quality_order: tuple[str, ...] = field(repr=False, default=())
    bpw: dict[str, float] = field(repr=False, default_factory=dict)

    @property
    def sources(self) -> tuple[Source, ...]:
        return (self.head_source, *self.tower_sources, *self.other_sources)

    @property
    def head_files(self) -> dict[str, str]:
        """Head role (head_weights, head_config, tokenizer) -> its file name in ``head_source``."""
        return {k: f for k in HEAD_KEYS if (f := self.head_source.files[k].file) is not None}

    @property
    def checkpoints(self) -> tuple[tuple[Source, Checkpoint], ...]:
        """(source, checkpoint) of whole checkpoint directories (the nvfp4 backend), pulled by name only."""
        return tuple((s, s.checkpoint) for s in self.other_sources if s.checkpoint is not None)

    @property
    def checkpoint_sources(self) -> tuple[Source, ...]:
        """Sources of whole checkpoint directories (the nvfp4 backend), pulled by name only."""
        return tuple(s for s, _ in self.checkpoints)

    def quants(self) -> list[str]:
        """GGUF quant types some tower source offers, best quality first (what ``auto`` picks from)."""
        offered = {q for s in self.tower_sources for q in s.quants}
        ranked = [q for q in self.quality_order if q in offered]
        return ranked + sorted(offered - set(ranked))

    def checkpoint_quants(self) -> list[str]:
        """The nvfp4 schemes a name can ask for (``clef-flash:NVFP4A16``), in catalog order."""
        return list(dict.fromkeys(ck.quant for _, ck in self.checkpoints))

    def source(self, alias: str) -> Source:
        for src in self.sources:
            if src.alias == alias.lower():
                return src
        raise ModelNotFound(f"unknown source {alias!r} for {self.name}; known: "
                            f"{', '.join(s.alias for s in self.sources[1:])}", field="model")

    def tower_source(self, quant: str, alias: str | None = None) -> Source:
        """The repository a quant is pulled from: the forced alias, else the first (pinned first) source.

        Without an alias a GGUF quant comes from a tower source (a native file only by @alias) and an
        nvfp4 scheme from a checkpoint source."""
        if alias is not None:
            src = self.source(alias)
            if quant not in src.quants:
                raise ModelNotFound(f"{src.repo} has no {quant} in the catalog; it offers: "
                                    f"{', '.join(src.quants) or 'no GGUF quants'}", field="model")
            return src
        for src in sorted((*self.tower_sources, *self.checkpoint_sources), key=lambda s: not s.pinned):
            if quant in src.quants:
                return src
        raise ModelNotFound(f"unknown quant {quant!r} for {self.name}; available: "
                            f"{', '.join(self.quants() + self.checkpoint_quants())}", field="model")

    def tower_size(self, quant: str, alias: str | None = None) -> tuple[int, str]:
        """(bytes, basis) of a tower file: known from any source (same model, same type), else estimated."""
        preferred = self.tower_source(quant, alias)
        if preferred.checkpoint is not None:  # a whole repository: the figure its card gives, if any
            if known := preferred.checkpoint.known_size():
                return known
            raise ModelNotFound(f"no size is known for {preferred.repo}", field="model")
        if known := preferred.files[quant].known_size():
            return known
        # Another repo's file of the same model and type is a close proxy (same tensors, same mix).
        for src in self.tower_sources:
            if quant in src.files and (known := src.files[quant].known_size()):
                return known[0], "proxy"
        bpw = self.bpw.get(quant)
        if bpw is None:
            raise ModelNotFound(f"no size and no bits-per-weight known for {quant}", field="model")
        return int(self.size_overhead_bytes + bpw * self.size_bytes_per_bpw), "estimate"


@dataclass(frozen=True)
class ModelRef:
    """A parsed model name. ``quant`` is a canonical type or ``auto``."""

    family: str
    quant: str
    source: str | None = None

    @property
    def auto(self) -> bool:
        return self.quant == AUTO

    def __str__(self) -> str:
        return f"{self.family}:{self.quant}" + (f"@{self.source}" if self.source else "")


@dataclass(frozen=True)
class Catalog:
    families: dict[str, Family]
    sources: dict[str, Source]
    quality_order: tuple[str, ...]
    bpw: dict[str, float]

    @classmethod
    def from_dict(cls, data: dict) -> Catalog:
        if data.get("format") != CATALOG_FORMAT:
            raise ModelNotFound(f"model catalog is not {CATALOG_FORMAT}", field="catalog")
        # Only needed when a source is a checkpoint: an older catalog without one needs no section.
        layout = {k: v for k, v in data.get("checkpoint_files", {}).items() if k != "comment"}
        sources = {sid: _source(sid, raw, layout) for sid, raw in data["sources"].items()}
        order = tuple(data["quant_types"]["order"])
        bpw = {k: float(v) for k, v in data["quant_types"]["bpw"].items()}
        families = {}
        for name, raw in data["families"].items():
            families[name] = Family(
                name=name, description=raw.get("description", ""),
                architecture=Architecture(**raw["architecture"]),
                memory=MemoryModel(**{k: v for k, v in raw["memory"].items() if k != "comment"}),
                size_overhead_bytes=int(raw["size_estimate"]["overhead_bytes"]),
                size_bytes_per_bpw=int(raw["size_estimate"]["bytes_per_bpw"]),
                head_source=sources[raw["head_source"]],
                tower_sources=tuple(sources[s] for s in raw["tower_sources"]),
                other_sources=tuple(sources[s] for s in raw.get("other_sources", ())),
                quality_order=order, bpw=bpw)
        return cls(families=families, sources=sources, quality_order=order, bpw=bpw)

    @classmethod
    def load(cls, path: str | Path | None = None) -> Catalog:
        path = Path(path) if path else CATALOG_PATH
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelNotFound(f"cannot read model catalog {path}: {exc}", field="catalog") from None

    def family(self, name: str) -> Family:
        try:
            return self.families[name.lower()]
        except KeyError:
            raise ModelNotFound(f"unknown model family {name!r}; known: {', '.join(self.families)}",
                                field="model") from None

    def quality_rank(self, quant: str) -> int:
        """0 = best; unknown types rank last."""
        return self.quality_order.index(quant) if quant in self.quality_order else len(self.quality_order)

    def parse(self, name: str, quant: str | None = None) -> ModelRef:
        """``FAMILY[:QUANT][@SOURCE]`` -> ModelRef, checked against the catalog.

        ``quant`` (the CLI's ``--quant``) overrides a quant in the name.
        """
        text = (name or "").strip()
        if not text:
            raise ModelNotFound("empty model name; try clef-flash:auto or clef-flash:Q4_K_M", field="model")
        alias = None
        if "@" in text:
            text, alias = text.split("@", 1)
            alias = alias.strip().lower() or None
        fam_name, _, in_name = text.partition(":")
        family = self.family(fam_name.strip())
        wanted = normalize_quant(quant or in_name or AUTO)
        if alias is not None:
            src = family.source(alias)  # validates the alias
            if wanted == AUTO and src.checkpoint is not None:
                wanted = src.checkpoint.quant  # auto chooses among GGUF quants; a checkpoint has one
        if wanted != AUTO:
            family.tower_source(wanted, alias)  # validates the quant (and that the source offers it)
        return ModelRef(family=family.name, quant=wanted, source=alias)


def normalize_quant(quant: str) -> str:
    """``q4_k_m`` -> ``Q4_K_M``; ``AUTO``/``auto`` -> ``auto``; ``bf16``/``f16`` spelled as BF16."""
    q = quant.strip()
    if q.lower() == AUTO:
        return AUTO
    return q.upper()


def _checkpoint(raw: dict | None, layout: dict) -> Checkpoint | None:
    if raw is None:
        return None
    merged = {**layout, **{k: v for k, v in raw.items() if k != "comment"}}  # a source may override the layout
    for key in ("allow_patterns", "required"):
        merged[key] = tuple(merged[key])
    merged["quant"] = normalize_quant(merged["quant"])
    return Checkpoint(**merged)


def _source(sid: str, raw: dict, layout: dict | None = None) -> Source:
    role = raw["role"]
    if role not in ROLES:
        raise KeyError(f"source {sid}: unknown role {role!r}")
    checkpoint = _checkpoint(raw.get("checkpoint"), layout or {})
    if checkpoint is not None and role != "nvfp4":
        raise KeyError(f"source {sid}: only an nvfp4 source is a checkpoint")
    files = {key: FileEntry(key=key, file=f.get("file"), size=f.get("size"), size_gb=f.get("size_gb"),
                            sha256=(f.get("sha256") or None) and f["sha256"].lower())
             for key, f in raw.get("files", {}).items()}
    if role == "head" and set(files) != set(HEAD_KEYS):
        raise KeyError(f"source {sid}: a head source lists exactly {', '.join(HEAD_KEYS)}")
    if role == "head" and any(f.file is None for f in files.values()):
        raise KeyError(f"source {sid}: a head source names each of its files")
    return Source(id=sid, family=raw["family"], alias=raw["alias"].lower(), role=role, repo=raw["repo"],
                  revision=raw.get("revision"), files=files, file_pattern=raw.get("file_pattern"),
                  evidence=raw.get("evidence", ""), checkpoint=checkpoint)


@lru_cache(maxsize=8)
def _load_cached(path: str) -> Catalog:
    return Catalog.load(path)


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The packaged catalog, or ``$CLEF_GGUF_CATALOG``, or ``path``; parsed once per path."""
    chosen = path or os.environ.get(CATALOG_ENV) or CATALOG_PATH
    return _load_cached(str(Path(chosen).resolve()))


def parse_name(name: str, quant: str | None = None, catalog: Catalog | None = None) -> ModelRef:
    return (catalog or load_catalog()).parse(name, quant)


def is_catalog_name(value: str, catalog: Catalog | None = None) -> bool:
    """True if ``value`` names a catalog model (so a CLI can tell it from a directory path)."""
    fam = value.split("@", 1)[0].split(":", 1)[0].strip().lower()
    return fam in (catalog or load_catalog()).families
