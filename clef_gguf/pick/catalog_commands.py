"""The CLI's printing for the cache: ``clef-gguf pull`` and ``clef-gguf list``."""

from __future__ import annotations

import argparse
import json
import sys

from clef_gguf.core.argtypes import positive_int
from clef_gguf.core.limits import GB
from clef_gguf.models.catalog import ModelRef, load_catalog
from clef_gguf.models.hfcache import cache_dir
from clef_gguf.models.hub import auto_order, pull
from clef_gguf.models.listing import available, list_local
from clef_gguf.models.pins import pin, pins_path
from clef_gguf.models.placement import DEFAULT_CONTEXT


def add_pull_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="clef-flash, clef-flash:Q4_K_M, clef:Q4_K_M, clef-flash:auto[@SOURCE]; "
                        "NVFP4 checkpoints for the nvfp4 backend: clef-flash:nvfp4a16 (W4A16), "
                        "clef-flash:nvfp4 (W4A4), clef:nvfp4 (27B W4A4)")
    parser.add_argument("--quant", help="quant type (Q4_K_M, ..., NVFP4A16, NVFP4) or 'auto' (overrides :QUANT "
                        "in the name; auto picks among GGUF quants only)")
    parser.add_argument("--ctx", type=positive_int, default=DEFAULT_CONTEXT, help="context the auto choice budgets for")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="print the resulting files as JSON")
    parser.add_argument("--update", action="store_true",
                        help="for a source pinned at its first pull (no revision in the "
                             "catalog): accept that main moved or a file changed, and re-pin; "
                             "without it such a pull is refused (pin_mismatch)")
    parser.epilog = ("A GGUF name pulls one tower file plus the head and tokenizer of the family's release. An "
                     "NVFP4 name (clef-flash:nvfp4a16, clef-flash:nvfp4, clef:nvfp4) pulls the checkpoint "
                     "repository's config, safetensors weights, index, tokenizer and head files into one "
                     "snapshot directory of the Hugging Face cache (the head from the release if the "
                     "repository lacks it), pinned and sha256-checked the same way; `clef-gguf pick` says "
                     "whether this GPU runs it natively.")


def run_pull(args: argparse.Namespace) -> int:
    cat = load_catalog()
    ref = cat.parse(args.name, args.quant)
    family = cat.family(ref.family)
    if ref.auto:
        rec, fitting = auto_order(family, ref.source, None, args.ctx, cat)
        print(f"auto: {rec.reason}", file=sys.stderr)
        ref = ModelRef(family.name, fitting[0], ref.source)
    src = family.tower_source(ref.quant, ref.source)
    before = None if src.pinned else pin(src.repo)
    if src.revision is not None and args.update:
        print(f"note: the catalog pins {src.repo} at {src.revision[:10]}; --update changes "
              "nothing there", file=sys.stderr)
    elif not src.pinned and before is None:
        print(f"note: {src.repo} has no pinned revision in the catalog; this first pull pins the "
              f"commit main points to now and each file's sha256 in {pins_path()}, and a later "
              "pull that finds them changed is refused unless --update", file=sys.stderr)
    if src.role == "native":
        print(f"note: {src.repo} holds native clef-arch GGUFs (head inside); the download is "
              "split once into a qwen35 tower + head + tokenizer (a copy of the tower's size)",
              file=sys.stderr)
    if src.checkpoint is not None:
        known = src.checkpoint.known_size()
        size = f" (about {known[0] / GB:.1f} GB, {known[1]} size)" if known else ""
        print(f"note: {src.repo} is a compressed-tensors NVFP4 {src.checkpoint.scheme} checkpoint for the "
              f"nvfp4 backend (PyTorch on CUDA); its checkpoint files are downloaded{size}",
              file=sys.stderr)
    files = pull(str(ref), progress=not args.no_progress, catalog=cat, update=args.update)
    after = None if src.pinned else pin(src.repo)
    if before and after and before["commit"] != after["commit"]:
        print(f"re-pinned {src.repo}: {before['commit']} -> {after['commit']}", file=sys.stderr)
    if args.json:
        print(json.dumps({"name": files.name, "revision": files.revision, "backend": files.backend,
                          "sha256": files.sha256, **{k: str(v) for k, v in files.paths().items()},
                          "vision": str(files.vision) if files.vision else None}, indent=2))
    else:
        print(f"{files.name}  ({files.revision})" + ("" if files.backend == "gguf" else f"  backend {files.backend}"))
        for role, path in files.paths().items():
            print(f"  {role:<13} {path}")
        if files.vision is not None:  # the release's vision tower and processor settings
            print(f"  {'vision':<13} {files.vision}")
    return 0


def add_list_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--available", action="store_true",
                        help="list the catalog instead of the cache: every GGUF quant and the NVFP4 checkpoints "
                             "(clef-flash:NVFP4A16, clef-flash:NVFP4, clef:NVFP4; backend nvfp4)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run_list(args: argparse.Namespace) -> int:
    cat = load_catalog()
    if args.available:
        rows = available(cat)
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        for r in rows:
            rev = ("pinned at first pull" if r["pinned_by"] is None else r["revision"][:10]
                   + (" (first pull)" if r["pinned_by"] == "first pull" else ""))
            size = "     ?" if r["size_bytes"] is None else f"{r['size_bytes'] / GB:6.2f}"
            repo = f"  {r['repo']}" if r["backend"] != "gguf" else ""
            print(f"{'*' if r['default'] else ' '} {r['name']:<30} {size} GB "
                  f"({r['size_basis']:<8}) {r['role']:<6} {rev}{repo}")
        print("* = what FAMILY:QUANT without @SOURCE pulls; native files are split on download; nvfp4 rows are "
              "compressed-tensors checkpoint repositories for the nvfp4 backend (PyTorch on CUDA; see `clef-gguf "
              "pick`)")
        return 0
    models = list_local(catalog=cat)
    if args.json:
        print(json.dumps([m.to_dict() for m in models], indent=2))
        return 0
    if not models:
        print(f"no Clef models in the Hugging Face cache ({cache_dir()}); try `clef-gguf pull clef-flash`")
    for m in models:
        towers = {s.alias for s in cat.family(m.family).tower_sources}
        missing = ("incomplete" if m.backend == "nvfp4" else "head missing" if m.source in towers
                   else "not split yet")
        state = (("ready" if m.head_ready else missing) + (", verified" if m.verified else "")
                 + ("" if m.backend == "gguf" else f" ({m.backend} checkpoint)"))
        rev = m.commit[:10] + (" (unpinned source)" if not m.source_pinned
                               else " (not the pinned revision)" if not m.pinned
                               else " (pinned at first pull)" if m.pinned_by == "first pull"
                               else "")
        print(f"{m.name:<32} {m.size_bytes / GB:6.2f} GB  {rev:<12} {state}")
    return 0
