"""``clef-gguf batch``: answer every record of a JSONL or Parquet file into an output file.

Order of work: read the questions schema and scan the input's ids (a bad schema or a duplicate id
fails here, before the model loads), open the output (what is there is done and skipped), then
compute the rest with the local or the Ray engine, writing each record as it is answered. The
summary goes to stderr; exit 0 when every record has a line (errors included), 130/143 after
Ctrl-C / SIGTERM (rerun to resume), 2 for a bad input, schema or flag.

A record's images are read as the CLI reads them (any path or URL), but a relative path is relative
to the input file's directory, so a data set and its pictures move together. A picture that cannot
be read fails its record only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from clef_gguf.runtime import engine
from clef_gguf.core import errors
from clef_gguf.core.argtypes import positive_int, seconds
from clef_gguf.core.deps import install_hint
from clef_gguf.bulk import records
from clef_gguf.bulk.output import Output
from clef_gguf.bulk.progress import Progress
from clef_gguf.bulk.stopping import Interrupted, Stopper
from clef_gguf.runtime.flags import add_model_arguments, load_model
from clef_gguf.runtime.settings import LoadSettings, for_replicas
from clef_gguf.media.sources import MediaPolicy

DEFAULT_LOG_EVERY_S = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    g = p.add_argument_group("batch")
    g.add_argument("--input", "-i", required=True, metavar="FILE",
                   help="JSONL (one SystemOne request per line, or {\"id\", \"state\"} lines with "
                        "--questions) or Parquet (.parquet/.pq: a 'state' column, an optional "
                        "'id' column and an optional 'images' (list of binary or string) or "
                        "'image' (binary or string) column, with --questions). A record's id is "
                        "its 'id', else its 0-based line/row number; two records with one id are "
                        "refused (exit 2). Images: as in a request (data: URI, base64, a path or "
                        "a URL); a relative path is relative to the input file's directory; a "
                        "Parquet binary value is the image file's bytes (PNG, JPEG, GIF, WebP); "
                        "a null 'image' is no image. A picture that cannot be read fails its "
                        "record only")
    g.add_argument("--output", "-o", required=True, metavar="FILE",
                   help="where the answers go, one record per input record in input order, in "
                        "the output's format (.parquet/.pq: Parquet, .jsonl/.json/.ndjson: JSONL, "
                        "anything else: the input's). An existing output is resumed: records "
                        "whose id it has are skipped. Parquet is journaled to FILE.journal.jsonl "
                        "and written when the job stops")
    g.add_argument("--questions", "-q", metavar="SCHEMA.json",
                   help="a JSON object of questions for every record that has none of its own "
                        "(required for Parquet input)")
    g.add_argument("--retry-errors", action="store_true",
                   help="also redo the records the output holds as errors (their old error lines "
                        "are dropped first); by default an error is an answer and is kept")
    g.add_argument("--truncate-state", action="store_true",
                   help="cut an over-long state to fit the window instead of answering that "
                        "record with context_too_large")
    g.add_argument("--window", type=positive_int, default=engine.WINDOW, metavar="N",
                   help="records computed together: requests about one state within N "
                        "consecutive records decode it once; also what an interruption may have "
                        f"to redo (written records are never redone) (default {engine.WINDOW})")
    g.add_argument("--log-every", type=seconds, default=DEFAULT_LOG_EVERY_S, metavar="SECONDS",
                   help="when stderr is not a terminal, a progress line every SECONDS (default "
                        f"{DEFAULT_LOG_EVERY_S:g}; 0: after every record); a terminal gets a "
                        "progress bar")
    r = p.add_argument_group("engine")
    r.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local (default): this process; ray: Ray Data actors, one model copy "
                        f"each (needs {install_hint('ray')})")
    r.add_argument("--ray-address", metavar="ADDR", default=os.environ.get("RAY_ADDRESS"),
                   help="the Ray cluster to use, e.g. ray://head:10001 or auto (default "
                        "$RAY_ADDRESS; unset: a private Ray on this machine, stopped at the end)")
    r.add_argument("--replicas", type=positive_int, default=1, metavar="N",
                   help="Ray actors, each holding one copy of the model (default 1)")
    r.add_argument("--threads-per-replica", type=positive_int, default=None, metavar="T",
                   help="CPUs each actor reserves and the tower's threads in it (default: --threads "
                        "if given, else this machine's cores / --replicas); replicas x T should not exceed the cores, "
                        "nor replicas x the model's memory the RAM")


def run(args: argparse.Namespace) -> int:
    if args.model is None and args.gguf is None:  # before reading a large input
        raise errors.MissingField("give --model (a model directory or catalog name) or --gguf "
                                  "with its head files", field="model")
    source, target = Path(args.input), Path(args.output)
    if target.exists() and source.exists() and target.samefile(source):
        raise errors.InvalidValue("--output is the input file: give another path", field="output")
    in_fmt = records.format_of(source)
    schema = records.load_schema(args.questions) if args.questions else None
    order = records.index_ids(source, in_fmt, schema)  # duplicate ids: refused before the load
    output = Output(target, records.format_of(target, default=in_fmt),
                    retry_errors=args.retry_errors)
    done = output.open()
    todo = sum(1 for record_id in order if record_id not in done)
    progress = Progress(todo, skipped=len(order) - todo, log_every=args.log_every)
    pending = (r for r in records.read(source, in_fmt, schema) if r.id not in done)
    stopper = Stopper()

    def write(record: dict) -> None:
        with stopper.writing():
            output.write(record)
            progress.update(record)

    policy = media_policy(source)
    interrupted = None
    with stopper:
        try:
            if todo:
                _compute(args, pending, write, stopper, progress.ready, policy)
        except Interrupted as exc:
            interrupted = exc
        finally:
            # a signal while tidying up takes its default action (Ctrl-C: exit 130): the
            # journal is on disk, so the next run finishes what this one could not
            stopper.restore()
            output.close(order)
    progress.summary(interrupted.name if interrupted else None)
    return 128 + interrupted.signum if interrupted else 0


def media_policy(source: Path) -> MediaPolicy:
    """Where a record's images may come from: any path or URL, as on the command line, a
    relative path read from the input file's directory."""
    return MediaPolicy(local_paths=True, base_dir=source.resolve().parent, url_allow=("*",))


def actor_settings(args: argparse.Namespace) -> LoadSettings:
    """What each Ray actor loads: the load flags, and --threads-per-replica (else --threads, else its
    share of the cores) as its threads."""
    return for_replicas(args, args.threads_per_replica or args.threads, args.replicas)


def _compute(args: argparse.Namespace, pending: Iterator[records.Record],
             write: Callable[[dict], None], stopper: Stopper, ready: Callable[[], None],
             policy: MediaPolicy) -> None:
    if args.engine == "ray":
        from clef_gguf.bulk import ray_engine

        def after_init() -> None:
            stopper.install()
            ready()

        settings = actor_settings(args)
        assert settings.threads is not None  # for_replicas gives each its share
        threads = settings.threads
        ray_engine.run(pending, write, settings=settings,
                       address=args.ray_address, replicas=args.replicas, threads=threads,
                       window=args.window, truncate_state=args.truncate_state,
                       after_init=after_init, media_policy=policy)
        return
    from clef_gguf.bulk.local import results

    with load_model(args) as clef:
        ready()
        for record in results(clef, pending, window=args.window,
                              truncate_state=args.truncate_state, media_policy=policy):
            write(record)
