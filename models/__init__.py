"""Model catalog: known Clef sources (pinned revisions, files, sizes, hashes) and model names."""

from clef_gguf.models.catalog import (
    AUTO,
    CATALOG_ENV,
    CATALOG_PATH,
    Architecture,
    Catalog,
    Family,
    FileEntry,
    MemoryModel,
    ModelRef,
    Source,
    is_catalog_name,
    load_catalog,
    normalize_quant,
    parse_name,
)

__all__ = [
    "AUTO",
    "CATALOG_ENV",
    "CATALOG_PATH",
    "Architecture",
    "Catalog",
    "Family",
    "FileEntry",
    "MemoryModel",
    "ModelRef",
    "Source",
    "is_catalog_name",
    "load_catalog",
    "normalize_quant",
    "parse_name",
]
