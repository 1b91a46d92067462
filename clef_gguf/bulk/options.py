"""What the batch job and the Ray Serve replicas pass to ``Clef.load`` from the model flags
(``cli_options.add_model_arguments``), with the thread count each copy of the model gets."""

from __future__ import annotations

import argparse
from pathlib import Path

from clef_gguf.core.cpus import available_cpus


def per_replica_threads(asked: int | None, replicas: int) -> int:
    """``asked``, else this machine's cores shared out over the replicas."""
    return asked or max(1, available_cpus() // replicas)


def _absolute(value: str | None) -> str | None:
    """A path that exists here, made absolute: a Ray worker need not share our working
    directory. Anything else (a catalog name, a path only the nodes have) goes as given."""
    if value is None or not Path(value).exists():
        return value
    return str(Path(value).resolve())


def load_kwargs(args: argparse.Namespace, threads: int) -> dict:
    """``Clef.load`` keywords, sent to each Ray actor or replica (they load their own copy)."""
    return {"model": _absolute(args.model), "gguf": _absolute(args.gguf),
            "head": _absolute(args.head), "head_config": _absolute(args.head_config),
            "tokenizer": _absolute(args.tokenizer), "threads": threads,
            "max_length": args.max_length, "head_dtype": args.head_dtype,
            "allow_download": not args.offline, "strict": args.strict,
            "state_cache_mb": args.state_cache_mb, "gpu_layers": args.gpu_layers,
            "backend": getattr(args, "backend", "auto"),
            "calibration": _absolute(getattr(args, "calibration", None)),
            "adapters": _adapters(getattr(args, "adapter", None))}


def _adapters(flags: list[str] | None) -> str | dict[str, str] | None:
    """``--adapter [NAME=]DIR`` flags as ``Clef.load(adapters=)`` takes them, directories absolute."""
    from clef_gguf.runtime.finetunes import parse_flags

    parsed = parse_flags(flags)
    if parsed is None or isinstance(parsed, (str, Path)):
        return _absolute(None if parsed is None else str(parsed))
    return {name: _absolute(str(directory)) or str(directory) for name, directory in parsed.items()}
