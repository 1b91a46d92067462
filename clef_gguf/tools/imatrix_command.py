"""``clef-gguf imatrix``: an importance matrix from decision records, for ``convert --imatrix``.

``--data`` is JSONL of SystemOne requests, one per line, read by ``eval``'s reader (an ``id`` and
``labels`` may be there and are ignored): batch inputs and labelled eval sets both work. Every
record is validated and encoded exactly as ``decide`` encodes it (``pipeline.encode``) before the
model loads, so a bad line is refused in a second, by number. Each prompt is then decoded on its own
through ``tower.imatrix_collector.Collector``, with ``--adapter``'s LoRA when given (checked against
the base as the runtime checks it), and the file is written in llama-imatrix's GGUF format.

This module is the command (an application: it reads records and fine-tune directories, which the
``convert`` layer may not import); the collection is ``tower/imatrix_collector.py``, the file format
``convert/imatrix_file.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from clef_gguf.core import errors
from clef_gguf.core.argtypes import positive_int

HELP = {
    "model": "converted f32, f16 or bf16 model directory (clef-gguf convert --outtype f32): the "
             "tower the importance matrix is measured on, and later quantized",
    "data": "JSONL records, one SystemOne request per line (batch's or eval's input; id and labels "
            "are ignored): the prompts whose activations are measured",
    "adapter": "fine-tune directory (clef-gguf convert adapter) to decode through: the matrix of a "
               "fine-tune's activations",
    "output": "imatrix file to write (llama-imatrix's GGUF format), for convert --imatrix FILE",
    "force": "overwrite --output if it exists",
    "threads": "llama.cpp threads (default: all available)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help=HELP["model"])
    p.add_argument("--data", required=True, metavar="RECORDS.jsonl", help=HELP["data"])
    p.add_argument("--adapter", metavar="DIR", help=HELP["adapter"])
    p.add_argument("--output", "-o", required=True, metavar="FILE", help=HELP["output"])
    p.add_argument("--force", action="store_true", help=HELP["force"])
    p.add_argument("--threads", type=positive_int, help=HELP["threads"])


def read_prompts(data: str | Path, tokenizer: Path) -> list[np.ndarray]:
    """The token ids ``decide`` would decode for each record of ``data``; the first line that is
    not a usable text request is refused, by its 1-based number."""
    from clef_gguf.evaluate.records import read
    from clef_gguf.pipeline.encode import Encoder
    from clef_gguf.pipeline.request import parse_request

    data = Path(data)
    if not data.is_file():
        raise errors.InvalidInput(f"--data file not found: {data}", field="data")
    encoder = Encoder.from_file(tokenizer)
    prompts = []
    for record in read(data):
        where = f"--data {data.name} line {record.index + 1}"
        if record.error is not None:
            err = record.error["error"]
            field = f" (field: {err['field']})" if err.get("field") else ""
            raise errors.InvalidInput(f"{where}: {err['code']}: {err['message']}{field}", field="data")
        try:
            parsed = parse_request(record.request)
            if not parsed.has_media:
                prompts.append(encoder.encode(parsed).ids)
        except errors.ClefError as exc:
            raise errors.InvalidInput(f"{where}: {exc}", field="data") from None
        if parsed.has_media:  # their embeddings come from the vision tower, not token ids
            raise errors.InvalidInput(f"{where} has images or videos: the importance matrix is "
                                      "measured on text prompts; leave such records out", field="data")
    if not prompts:
        raise errors.InvalidInput(f"--data {data} holds no records", field="data")
    return prompts


def run(args: argparse.Namespace) -> int:
    from clef_gguf.convert.imatrix_file import write_sums
    from clef_gguf.formats.files import from_directory
    from clef_gguf.formats.finetune_files import AdapterFiles
    from clef_gguf.tower.imatrix_collector import Collector

    start = time.perf_counter()
    output = Path(args.output)
    if output.exists() and not args.force:
        raise errors.InvalidSetting(f"--output {output} exists: pass --force to overwrite it", field="output")
    if not output.parent.is_dir():
        raise errors.InvalidSetting(f"--output's directory does not exist: {output.parent}", field="output")
    files = from_directory(Path(args.model), backend="gguf")
    prompts = read_prompts(args.data, files.tokenizer)
    tune = AdapterFiles.from_directory(args.adapter) if args.adapter else None
    with Collector(files.tower, n_ctx=max(len(ids) for ids in prompts), threads=args.threads) as collector:
        if tune is not None:
            from clef_gguf.runtime.finetunes import check_fits  # torch: only with a fine-tune

            check_fits(tune, tune.name, files.tower.name, n_embd=collector.n_embd,
                       n_vocab=collector.n_vocab, n_layer=collector.n_layer)
            collector.use_adapter(tune.adapter)
        for ids in prompts:
            collector.add(ids)
        result = collector.result()
    write_sums(output, result.sums, result.counts, datasets=[str(args.data)], chunks=result.prompts,
               chunk_size=result.chunk_size)
    print(json.dumps({"output": str(output), "model": str(args.model), "tower": files.tower.name,
                      "adapter": tune.name if tune is not None else None, "entries": len(result.sums),
                      "prompts": result.prompts, "tokens": result.tokens,
                      "seconds": round(time.perf_counter() - start, 3)}, indent=2))
    return 0
